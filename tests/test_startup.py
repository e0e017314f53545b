"""`hearthlm bench --startup`'s runs (fresh processes) and `hearthlm prepare`, on a tiny model."""
from gguf import GGMLQuantizationType as T

from hearthlm.startup_bench import KEYS, bench_startup, prepare, run_once
from tiny_gguf import write_tiny


def test_startup_run_reports_its_figures(tmp_path):
    path = str(write_tiny(tmp_path / "tiny.gguf", qtype=T.Q8_0))
    r = run_once("hearthlm", path, 64)
    assert all(r[k] > 0 for k in KEYS), r
    assert r["start_to_token_s"] > r["open_s"] + r["first_token_s"]  # the process start counts too
    assert r["weight_cache"] == {"cpu": "hit"} or r["weight_cache"] == {"cpu": "written"}
    rows = bench_startup(path, repeat=1, n_ctx=64, compare=False)
    assert [x["engine"] for x in rows] == ["hearthlm"] and rows[0]["weight_cache"] == {"cpu": "hit"}


def test_prepare_says_what_it_does(tmp_path):
    path = str(write_tiny(tmp_path / "tiny.gguf", qtype=T.Q8_0))
    said = []
    prepare(path, say=said.append)
    assert len(said) == 5 and "done" in said[-1]
