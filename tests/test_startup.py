"""`hearthlm bench --startup`'s runs (fresh processes) and `hearthlm prepare`, on a tiny model."""
from gguf import GGMLQuantizationType as T
from tiny_gguf import write_tiny

from hearthlm.bench.startup import KEYS, bench_startup, prepare, run_once


def test_startup_run_reports_its_figures(tmp_path):
    path = str(write_tiny(tmp_path / "tiny.gguf", qtype=T.Q8_0))
    r = run_once("hearthlm", path, 64)
    assert all(r[k] > 0 for k in KEYS), r
    assert r["start_to_token_s"] > r["open_s"] + r["first_token_s"]  # the process start counts too
    assert r["weight_cache"] == {"cpu": "hit"} or r["weight_cache"] == {"cpu": "written"}
    rows = bench_startup(path, repeat=1, n_ctx=64)
    assert [x["engine"] for x in rows] == ["hearthlm"] and rows[0]["weight_cache"] == {"cpu": "hit"}


def test_prepare_says_what_it_does(tmp_path):
    path = str(write_tiny(tmp_path / "tiny.gguf", qtype=T.Q8_0))
    said = []
    prepare(path, say=said.append)
    assert len(said) == 5 and "done" in said[-1]


def test_a_cold_kernel_cache_is_announced_at_load(tmp_path):
    """With numba's cache empty the first generation compiles for many seconds: the CPU
    backend says so when the model is loaded, before that wait; with a warm cache it is quiet."""
    import os
    import subprocess
    import sys
    code = ("from hearthlm.backends.cpu.backend import CPUBackend, kernels_cached\n"
            "print('cached', kernels_cached()); CPUBackend().loaded()\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert "cached False" in cold.stdout and "compiling the CPU kernels" in cold.stdout + cold.stderr
    from hearthlm.backends.cpu import dot
    from hearthlm.backends.cpu.backend import kernels_cached
    dot.dot_any(dot.TAGS[0], *[a for a in _tiny_nib32()])  # compiled (or loaded) into this process's cache
    assert kernels_cached()


def _tiny_nib32():
    import numpy as np
    qs, d, m = np.zeros((1, 1, 16, 32), np.uint8), np.zeros((1, 2, 16), np.float32), np.zeros((1, 2, 1), np.float32)
    xq, xd, xs = np.zeros((1, 64), np.int8), np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32)
    sup = np.zeros((1, 1, 1, 1), np.uint16)  # no super-block scales (qtypes)
    return qs, d, m, sup, 0, np.float32(0), xq, xd, xs, np.zeros((1, 16), np.float32)
