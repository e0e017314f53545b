"""Record llama.cpp on the three real models with their weights dequantized to F32 (dequantize.py):
the goldens' cases (same prompt ids), 32 greedy steps, each step's top-5 log-probs, into
tests/data/golden_dequantized.json. On the quantized files llama.cpp rounds the activations to
8 bits for each quantized matmul, which moves its log-probs by up to ~0.2 nats (top token) from
exact arithmetic on the same weights: more than a 2% error in the attention scale moves ours.
On the F32 copies it computes in float32 (K/V cached as f16, its default, as ours are), a
reference tight enough for tests/golden.py to compare log-probs at every step. Once, with
llama-cpp-python (an oracle, never a dependency), from the repo root:
  .venv/bin/python tests/parity/record_dequantized.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
(this Python needs hearthlm's test deps: gguf for the dequantization, the models installed)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
GOLDEN = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1.visible.json",
          "gemma-3-270m": "gemma-3-270m-q4_k_m.visible.json",
          "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct.visible.json"}
N_STEPS = 32


def llama_side(jobs: list[dict]) -> dict:
    """Under the llama-cpp-python interpreter: greedy steps as the goldens were recorded
    (n_ctx 1024, 2 threads, llama-cpp-python's defaults otherwise)."""
    import llama_cpp
    from llama_cpp import Llama
    sys.path.insert(0, str(HERE))
    from record_kv_quant import greedy
    out = {"llama_cpp_python": llama_cpp.__version__, "models": {}}
    for j in jobs:
        llm = Llama(j["path"], n_ctx=1024, n_batch=1024, logits_all=True, verbose=False, n_threads=2)
        out["models"][j["name"]] = {"cases": [greedy(llm, p, N_STEPS) for p in j["prompts"]]}
        print(j["name"], "done", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python")
    ap.add_argument("--eval", help=argparse.SUPPRESS)  # the llama-cpp-python side: a jobs file
    ap.add_argument("models", nargs="*")
    a = ap.parse_args()
    if a.eval:
        print(json.dumps(llama_side(json.loads(Path(a.eval).read_text()))))
        sys.exit()
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from conftest import _model
    from dequantize import dequantize
    out_path = DATA / "golden_dequantized.json"
    with tempfile.TemporaryDirectory() as d:
        jobs = []
        for name in a.models or GOLDEN:
            f32 = Path(d) / f"{name}.f32.gguf"
            dequantize(str(_model(name)), str(f32))
            cases = json.loads((DATA / GOLDEN[name]).read_text())["cases"]
            jobs.append({"name": name, "path": str(f32), "prompts": [c["prompt_ids"] for c in cases]})
        (Path(d) / "jobs.json").write_text(json.dumps(jobs))
        res = subprocess.run([a.llama_python, __file__, "--eval", str(Path(d) / "jobs.json")],
                             stdout=subprocess.PIPE, text=True, check=True)
    new = json.loads(res.stdout)
    old = json.loads(out_path.read_text()) if out_path.exists() else {"models": {}}
    new["models"] = {**old["models"], **new["models"]}
    new["how"] = ("llama.cpp on the models' weights dequantized to F32 (tests/parity/dequantize.py), "
                  "n_ctx 1024, 2 threads, K/V f16; the goldens' prompt ids")
    out_path.write_text(json.dumps(new) + "\n")
    print("wrote", out_path)
