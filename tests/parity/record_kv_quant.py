"""Record llama.cpp with a quantized KV cache (-ctk/-ctv q8_0 and q4_0, flash attention as it
requires), once, with llama-cpp-python (an oracle, never a dependency), with its Hadamard rotation
of quantized K/V off (LLAMA_ATTN_ROT_DISABLE=1: hearthlm quantizes the rows as they are; the
perplexity with the rotation, llama.cpp's default, is kept beside as "ppl_rotated"): the golden cases' greedy
steps and top-5 log-probs, and the perplexity of tests/data/ppl_text.txt, on the three real
models -> tests/data/kv_quant.json. Run from the repo root with a Python that has llama_cpp, given
the three models' paths (tests/conftest.py's _model(name) resolves them):
  python tests/parity/record_kv_quant.py SMOLLM2.gguf GEMMA3.gguf QWEN2.5.gguf"""
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

GOLDEN = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1.visible.json",
          "gemma-3-270m": "gemma-3-270m-q4_k_m.visible.json",
          "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct.visible.json"}
TYPES = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
PPL_CTX = 512


def _llm(path: str, t: int, n_ctx: int, rotate: bool = False) -> Llama:
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if rotate else "1"  # read as each context is made
    return Llama(path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, n_threads=2,
                 type_k=t, type_v=t, flash_attn=True)


def greedy(llm: Llama, prompt: list[int], n_steps: int) -> dict:
    llm.reset()
    llm.eval(prompt)
    ids, steps = [], []
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    for _ in range(n_steps):
        lp = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        lp = lp - lp.max()
        lp -= np.log(np.exp(lp).sum())
        top = np.argsort(-lp, kind="stable")[:5]
        steps.append({"top_ids": [int(x) for x in top], "top_logprobs": [round(float(lp[x]), 5) for x in top]})
        ids.append(int(top[0]))
        if llama_cpp.llama_vocab_is_eog(vocab, int(top[0])):
            break
        llm.eval([int(top[0])])
    return {"prompt_ids": prompt, "greedy_ids": ids, "steps": steps}


def perplexity(llm: Llama, text: str) -> float:
    return float(np.exp(np.mean(chunk_nlls(llm, text, PPL_CTX)[2])))


if __name__ == "__main__":
    text = (ROOT / "tests/data/ppl_text.txt").read_text(encoding="utf-8")
    out = {"llama_cpp_python": llama_cpp.__version__, "models": {},
           "attn_rot": "off (LLAMA_ATTN_ROT_DISABLE=1); ppl_rotated: llama.cpp's default, with it"}
    for (name, golden), path in zip(GOLDEN.items(), sys.argv[1:4], strict=True):
        out["models"][name] = {}
        for tname, t in TYPES.items():
            cases = json.loads((ROOT / "tests/data" / golden).read_text())["cases"]
            llm = _llm(path, t, 1024)
            rec = [{"prompt": c["prompt"], **greedy(llm, c["prompt_ids"], 32)} for c in cases]
            out["models"][name][tname] = {"cases": rec, "ppl": perplexity(_llm(path, t, PPL_CTX), text),
                                          "ppl_rotated": perplexity(_llm(path, t, PPL_CTX, rotate=True), text)}
            print(name, tname, out["models"][name][tname]["ppl"], flush=True)
    (ROOT / "tests/data/kv_quant.json").write_text(json.dumps(out) + "\n")
