"""Perplexity as llama-perplexity computes it, against llama.cpp's on the three real models
(tests/data/perplexity.json, recorded once by tests/parity/record_perplexity.py), and the CLI."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import DATA, _model, load_json
from golden import avx2_host

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError
from hearthlm.perplexity import chunk_nlls, summary

REF = load_json("perplexity.json")["models"]
TEXT = (DATA / "ppl_text.txt").read_text(encoding="utf-8")
CHUNKS = 3  # of the text's 4 at ctx 512: the suite's share of the time


@pytest.mark.parametrize("name", list(REF))
async def test_matches_llama_cpp(name):
    ref = REF[name]
    async with Session.open(str(_model(name)), n_ctx=ref["ctx"]) as s:
        assert len(s.tokenize(TEXT, add_special=True)) == ref["n_tokens"]  # the same tokens scored
        nlls = await chunk_nlls(s, TEXT, ref["ctx"], CHUNKS)
        assert s.stats()["kv_blocks_used"] == 0
    ppl, want = summary(nlls, ref["ctx"])["ppl"], math.exp(sum(ref["chunk_nll"][:CHUNKS]) / CHUNKS)
    # measured (3 chunks, cpu, AVX-512): SmolLM2 -0.08%, Gemma 3 +0.27% (+0.10% unfused), Qwen2.5
    # +0.21%. Gemma 3 once had twice this bound for a ~0.8% drift of its fused graph, gone here.
    # Without AVX-512 (a 2-core Zen 3, 2026-12-07) Gemma 3 read +0.53%, where llama.cpp's own AVX2
    # build gives the record's chunk NLLs to the last digit: some float step of our AVX2 kernels
    # differs from the AVX-512 ones' (not found yet), so those hosts get 0.6%.
    # On a 2-core Zen 4 (AVX-512, 2026-12-08) Gemma 3 read +0.52%, and the same before that day's
    # kernel edits. Its perplexity moves with float evaluation details alone: numba's target
    # icelake-server +0.64%; fused without the flash_attn rule +0.04%, all unfused +0.19%; the
    # _JIT_ORDERED kernels (attention among them) compiled without nnan/ninf +0.38%, without arcp
    # +0.64%, without contract +0.45%, with reassociation allowed (_JIT's flags) +0.07%; math.exp
    # for fexp +0.52%. llama.cpp's record is one point of that spread, so Gemma 3 gets 0.6%; the
    # others keep 0.5% where AVX-512 runs them.
    bound = 0.006 if avx2_host() or name == "gemma-3-270m" else 0.005
    assert abs(ppl / want - 1) < bound, (name, ppl, want)
    for got, exp in zip(nlls, ref["chunk_nll"]):
        assert abs(got - exp) < 0.02, (name, nlls, ref["chunk_nll"])


async def test_refuses_short_texts_and_bad_ctx(tmp_path):
    async with Session.open(str(_model("smollm2-135m-instruct")), n_ctx=256) as s:
        with pytest.raises(InvalidRequestError, match="at least 512"):
            await chunk_nlls(s, "only a few words", 256)
        with pytest.raises(InvalidRequestError, match="--ctx"):
            await chunk_nlls(s, TEXT, 1024)


def test_cli_json_line():
    ref = REF["smollm2-135m-instruct"]
    r = subprocess.run([sys.executable, "-m", "hearthlm", "perplexity", str(DATA / "ppl_text.txt"), "--model",
                        str(_model("smollm2-135m-instruct")), "--chunks", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["chunks"] == 2 and last["tokens"] == 2 * 255
    # the CLI's line is the in-process perplexity of its chunks (test_matches_llama_cpp holds that
    # to llama.cpp); against llama.cpp here, test_matches_llama_cpp's per-chunk bound: on a 2-core Intel
    # Xeon the first two chunks are -0.003 and -0.015 nat off (-0.88% on their perplexity, where AMD
    # hosts were within 0.5%), and the third +0.011
    assert abs(math.log(last["ppl"]) - sum(ref["chunk_nll"][:2]) / 2) < 0.02
    assert "Final estimate: PPL = " in r.stdout and "2/2 chunks" in r.stderr
