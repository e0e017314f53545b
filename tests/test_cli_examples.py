"""The CLI and the examples, run as a user would (subprocesses on the default model)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def test_cli_generate_streams_text(smollm2_path):
    r = run("-m", "hearthlm", "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_cli_bad_model_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not a gguf file" * 4)
    r = run("-m", "hearthlm", "generate", "hi", "--model", str(bad))
    assert r.returncode == 1
    assert "hearthlm: error:" in r.stderr and "GGUF" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_graph_and_bench_help():
    r = run("-m", "hearthlm", "bench", "--help")
    assert r.returncode == 0 and "--compare-llama-cpp" in r.stdout


@pytest.mark.parametrize("example", ["generate.py", "chat_stream.py"])
def test_examples_run(smollm2_path, example):
    r = run(str(ROOT / "examples" / example))
    assert r.returncode == 0, r.stderr
    if example == "generate.py":
        assert "finish_reason=" in r.stdout
    else:
        assert r.stdout.count("Q: ") == 2 and r.stdout.count("A: ") == 2


def test_cli_bench_json_schema(smollm2_path):
    """Throughput constrained vs not, same run: one row per level, both generated tokens."""
    pytest.importorskip("llguidance")
    r = run("-m", "hearthlm", "bench", "--json-schema", "examples/bench_schema.json", "--concurrency", "1,2",
            "--decode-tokens", "8", "--repeat", "1", "--n-ctx", "512", "--json")
    assert r.returncode == 0, r.stderr
    import json
    rows = json.loads(r.stdout)["rows"]  # beside the host and build facts
    assert [x["concurrency"] for x in rows] == [1, 2]
    for x in rows:
        assert x["plain_tokens_per_req"] == 8 and x["constrained_tokens_per_req"] == 8
        assert x["ratio"] > 0 and x["mask_ms_per_token"] > 0
