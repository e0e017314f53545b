"""Add to tests/data/quant_parity.json, per type and case, llama.cpp's greedy steps and top-5
log-probs on the same weights dequantized to F32 (dequantize.py, gguf-py's dequantization):
"f32_weights". On the quantized files llama.cpp rounds the activations to 8 bits for its
quantized dot products (its top-1 log-probs move by up to 0.38 nat on the ternary types from
its F32 run); the numpy reference does not round them, so this run is its reference
(tests/test_quant_parity.py). Once, with llama-cpp-python (an oracle, never a dependency):
  .venv/bin/python tests/parity/record_quant_f32.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
CODE = r"""
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
jobs = json.loads(open(sys.argv[1]).read())
out = {}
for name, (path, cases) in jobs.items():
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, logits_all=True, verbose=False)
    res = []
    for c in cases:  # as record_quant_types.py's steps(), for as many steps as that run took
        llm.reset()
        llm.eval(c["prompt_ids"])
        ids, steps = [], []
        for _ in range(c["n_steps"]):
            lg = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
            lp = lg - lg.max(); lp -= np.log(np.exp(lp).sum())
            top = np.argsort(-lp, kind="stable")[:5]
            steps.append({"top_ids": [int(t) for t in top], "top_logprobs": [round(float(lp[t]), 5) for t in top]})
            ids.append(int(top[0]))
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), int(top[0])):
                break
            llm.eval([int(top[0])])
        res.append({"greedy_ids": ids, "steps": steps})
    out[name] = res
print(json.dumps(out))
"""

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from dequantize import dequantize
    path = DATA / "quant_parity.json"
    data = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as d:
        jobs = {}
        for name, cases in data.items():
            f32 = str(Path(d) / f"{name}.f32.gguf")
            dequantize(str(DATA / "quant" / f"{name}.gguf"), f32)
            jobs[name] = (f32, [{"prompt_ids": c["prompt_ids"], "n_steps": len(c["greedy_ids"])} for c in cases])
        (Path(d) / "jobs.json").write_text(json.dumps(jobs))
        res = subprocess.run([a.llama_python, "-c", CODE, str(Path(d) / "jobs.json")], stdout=subprocess.PIPE,
                             text=True, check=True)
    for name, runs in json.loads(res.stdout).items():
        for case, run in zip(data[name], runs, strict=True):
            case["f32_weights"] = run
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
