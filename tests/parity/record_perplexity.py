"""Record llama.cpp's perplexity on the three real models, once, with llama-cpp-python (an oracle,
never a dependency): llama-perplexity's method (tools/perplexity/perplexity.cpp) on
tests/data/ppl_text.txt at ctx 512 -> tests/data/perplexity.json. Run from the repo root:
  .venv/bin/python tests/parity/record_perplexity.py"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

CTX = 512
MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"]


def chunk_nlls(llm: Llama, text: str, ctx: int, name: str = "") -> tuple[list[int], bool, list[float]]:
    """The text's tokens, whether a BOS starts each chunk, and each chunk's mean NLL over its second half."""
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)  # common_tokenize(ctx, prompt, true)
    add_bos = llm._model.add_bos_token() if hasattr(llm._model, "add_bos_token") else ids[0] == llm.token_bos()
    first, nlls = ctx // 2, []
    for i in range(len(ids) // ctx):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if add_bos:
            chunk = [llm.token_bos()] + chunk[1:]
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:ctx], np.float64)
        lp = logits - logits.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        nlls.append(float(-np.mean(lp[np.arange(first, ctx - 1), chunk[first + 1:]])))
        print(name, i, nlls[-1], flush=True)
    return ids, bool(add_bos), nlls


def record(name: str, text: str) -> dict:
    from conftest import _model  # hearthlm's resolver: only where this script records
    llm = Llama(str(_model(name)), n_ctx=CTX, n_batch=CTX, logits_all=True, verbose=False, n_threads=2)
    ids, add_bos, nlls = chunk_nlls(llm, text, CTX, name)
    return dict(ctx=CTX, n_tokens=len(ids), add_bos=add_bos, chunk_nll=nlls, ppl=float(np.exp(np.mean(nlls))))


if __name__ == "__main__":
    import llama_cpp
    text = (ROOT / "tests/data/ppl_text.txt").read_text(encoding="utf-8")
    out = {"llama_cpp_python": llama_cpp.__version__, "text": "tests/data/ppl_text.txt (the Apache License 2.0)",
           "models": {m: record(m, text) for m in MODELS}}
    (ROOT / "tests/data/perplexity.json").write_text(json.dumps(out, indent=1) + "\n")
