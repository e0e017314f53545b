"""Record llama.cpp's perplexity with each KV cache type (-ctk/-ctv f16, q8_0, q4_0, q5_0, q5_1,
iq4_nl; flash attention on, as a quantized V requires), once, with llama-cpp-python (an oracle,
never a dependency): tests/data/ppl_text.txt at ctx 512 by llama-perplexity's method, on the three
real models, each quantized type with llama.cpp's Hadamard rotation of K/V (its default since
PR #21038) and without it (LLAMA_ATTN_ROT_DISABLE=1, read as each context is made)
-> tests/data/kv_types_ppl.json. Run from the repo root with a Python that has llama_cpp:
  python tests/parity/record_kv_types.py SMOLLM2.gguf GEMMA3.gguf QWEN2.5.gguf"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from record_perplexity import chunk_nlls  # noqa: E402

MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]
TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0,
         "q5_0": llama_cpp.GGML_TYPE_Q5_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1, "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL}
CTX = 512


def run(path: str, t: int, rotate: bool, text: str) -> dict:
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if rotate else "1"
    llm = Llama(path, n_ctx=CTX, n_batch=CTX, logits_all=True, verbose=False, n_threads=2,
                type_k=t, type_v=t, flash_attn=True)
    _, _, nlls = chunk_nlls(llm, text, CTX)
    return dict(chunk_nll=nlls, ppl=float(np.exp(np.mean(nlls))))


if __name__ == "__main__":
    text = (ROOT / "tests/data/ppl_text.txt").read_text(encoding="utf-8")
    out = {"llama_cpp_python": llama_cpp.__version__, "ctx": CTX, "flash_attn": True,
           "rotation": "plain: LLAMA_ATTN_ROT_DISABLE=1; rot: llama.cpp's default (K and V of a quantized "
                       "type rotated where head_dim % 64 == 0)", "models": {}}
    dest = ROOT / "tests/data/kv_types_ppl.json"
    for name, path in zip(MODELS, sys.argv[1:4], strict=True):
        res = out["models"][name] = {}
        for tname, t in TYPES.items():
            res[tname] = run(path, t, False, text)
            if tname != "f16":
                res[tname + "+rot"] = run(path, t, True, text)
            print(name, tname, res[tname]["ppl"], res.get(tname + "+rot", {}).get("ppl"), flush=True)
            dest.write_text(json.dumps(out, indent=1) + "\n")  # as it goes: a long run
