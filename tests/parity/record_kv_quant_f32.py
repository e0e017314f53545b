"""Add to tests/data/kv_quant.json, per q4_0 golden case, the greedy ids of llama.cpp's run with the
same cache type on the model's weights dequantized to F32 (dequantize.py): "f32_weights_ids".
The two llama.cpp runs differ only by its 8-bit rounding of activations, yet a q4_0 cache turns
that into other K/V codes and their paths part within a few steps (SmolLM2: at steps 8, 17, 2, 3,
1, 1); the step where they part bounds how far tests/test_golden_kv_quant.py holds ours to
llama.cpp's path. Once, with llama-cpp-python (an oracle, never a dependency), from the repo root:
  .venv/bin/python tests/parity/record_kv_quant_f32.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
WHICH = {"smollm2-135m-instruct": ["q4_0"], "gemma-3-270m": ["q4_0"]}  # the q4_0 goldens the suite runs


def llama_side(jobs: list[dict]) -> list[list[list[int]]]:
    """Under the llama-cpp-python interpreter: record_kv_quant.py's context and greedy walk."""
    sys.path.insert(0, str(HERE))
    from record_kv_quant import TYPES, _llm, greedy
    out = []
    for j in jobs:
        llm = _llm(j["path"], TYPES[j["kv"]], 1024)
        out.append([greedy(llm, p, 32)["greedy_ids"] for p in j["prompts"]])
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python")
    ap.add_argument("--eval", help=argparse.SUPPRESS)  # the llama-cpp-python side: a jobs file
    a = ap.parse_args()
    if a.eval:
        print(json.dumps(llama_side(json.loads(Path(a.eval).read_text()))))
        sys.exit()
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from conftest import _model
    from dequantize import dequantize
    path = DATA / "kv_quant.json"
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as d:
        jobs = []
        for name, kvs in WHICH.items():
            f32 = Path(d) / f"{name}.f32.gguf"
            dequantize(str(_model(name)), str(f32))
            for kv in kvs:
                jobs.append({"name": name, "kv": kv, "path": str(f32),
                             "prompts": [c["prompt_ids"] for c in data["models"][name][kv]["cases"]]})
        (Path(d) / "jobs.json").write_text(json.dumps(jobs))
        res = subprocess.run([a.llama_python, __file__, "--eval", str(Path(d) / "jobs.json")],
                             stdout=subprocess.PIPE, text=True, check=True)
    for j, runs in zip(jobs, json.loads(res.stdout), strict=True):
        for case, ids in zip(data["models"][j["name"]][j["kv"]]["cases"], runs, strict=True):
            case["f32_weights_ids"] = ids
    path.write_text(json.dumps(data) + "\n")
    print("wrote", path)
