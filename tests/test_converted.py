"""Test models made the way users' files are made: tiny Hugging Face checkpoints (tests/parity/hf/make.py)
converted by llama.cpp's own convert_hf_to_gguf.py (convert.py), so a test cannot share a loader's
assumption about the metadata. Each file's llama.cpp outputs were recorded once (record.py) beside it
in tests/data/converted. Criteria: the tokenizer's flags and token ids exact (plain, with special
tokens added, special-token text parsed); decoders: the golden README's greedy criterion and, F32 on
both sides, log-probs within 0.05 nat (as test_arch_parity); encoders: cosine >= 0.999 per text;
rerankers: llama-server's pairs token for token and scores within 1e-3."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm import Session

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402
from test_arch_parity import _logprobs  # noqa: E402

DIR = Path(__file__).parent / "data" / "converted"
NAMES = sorted(p.stem for p in DIR.glob("*.gguf") if not p.stem.endswith(".mmproj"))  # vision: test_vision_fixture
QUERY = "what is warm?"  # record.py's


def rec(name: str) -> dict:
    return json.loads((DIR / f"{name}.json").read_text())


def test_every_converted_model_is_recorded():
    assert NAMES and all((DIR / f"{n}.json").exists() for n in NAMES), "record it: tests/parity/hf/record.py"


@pytest.mark.parametrize("name", NAMES)
def test_tokens_match_llama_cpp(name):
    """Mutations: adding [SEP] after the file's add_eos on WordPiece text (as before #37) fails bert's
    add_special ids; ignoring the file's add_sep_token fails bert's flags."""
    from hearthlm.model_zoo.model import load_model
    r = rec(name)
    m = load_model(str(DIR / f"{name}.gguf"))
    try:
        tok = m.tokenizer
        assert {"bos": tok.add_bos, "eos": tok.add_eos, "sep": tok.add_sep} == r["flags"]
        assert [tok.encode(t) for t in r["texts"]] == r["tokens"]["plain"]
        assert [tok.encode(t, add_special=True) for t in r["texts"]] == r["tokens"]["add_special"]
        assert tok.encode(r["marked"], parse_special=True) == r["tokens"]["parse_special"]
        assert tok.suppress_ids == tuple(r.get("suppress_tokens", ()))  # gemma4-12b's file names some
    finally:
        m.close()


async def test_suppressed_tokens_are_never_generated():
    """Gemma 4 12B's file bans ids (tokenizer.ggml.suppress_tokens) as llama.cpp's samplers do: pushed to the
    top by a logit bias, the image soft token (9) still never comes; an unlisted one (10) does. Mutations:
    Session not adding the file's ids to the request's logit bias fails it; keeping the id past the vocabulary
    fails test_tokens_match_llama_cpp[gemma4-12b]."""
    async with Session.open(str(DIR / "gemma4-12b.gguf"), backend="reference", n_ctx=64, weight_cache=False) as s:
        banned = await s.generate([2, 101, 131], max_tokens=3, temperature=0, logit_bias={9: 100.0})
        free = await s.generate([2, 101, 131], max_tokens=3, temperature=0, logit_bias={10: 100.0})
        sampled = await s.generate([2, 101, 131], max_tokens=8, temperature=1.0, seed=1,
                                   logit_bias={0: 100.0, 4: 100.0, 9: 100.0})
    assert 9 not in banned.token_ids and free.token_ids == [10, 10, 10]
    assert not {0, 4, 9} & set(sampled.token_ids)
    from hearthlm.core.errors import ModelLoadError
    from hearthlm.model_zoo.gguf_file import GGUFFile
    from hearthlm.model_zoo.tokenizer import Tokenizer
    with GGUFFile.open(DIR / "gemma4-12b.gguf") as f:
        md = dict(f.metadata)
    for bad in ("9", 9, ["x"]):  # not an array of ids: named
        with pytest.raises(ModelLoadError, match="suppress_tokens"):
            Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.suppress_tokens": bad})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", [n for n in NAMES if "greedy" in rec(n)])
async def test_decoder_matches_llama_cpp(monkeypatch, name, backend):
    """Mutations: qwen3moe.moe_ffn not renormalizing the chosen experts' weights (norm_w=False) fails
    qwen3vlmoe-vision; gemma4 without its per-expert down scales (down_s=None), or its router input not
    divided by sqrt(n_embd), fails gemma4-moe."""
    monkeypatch.setattr(golden, "TOP1_LOGPROB_TOL", 0.05)  # F32 weights on both sides
    failures = []
    async with Session.open(str(DIR / f"{name}.gguf"), backend=backend, n_ctx=256, weight_cache=False) as s:
        for i, case in enumerate(rec(name)["greedy"]):
            c = await s.generate(case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0,
                                 top_logprobs=5)
            why = golden.compare(case, c.token_ids, c.top_logprobs, c.finish_reason) or _logprobs(case, c)
            if why:
                failures.append(f"text {i}: {why}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", [n for n in NAMES if "greedy" not in rec(n)])
async def test_encoder_matches_llama_cpp(name, backend):
    """Mutation: the old rerank pairing ([SEP] for every WordPiece file whatever add_sep_token says)
    gives bert-reranker `[CLS] q [SEP] [SEP] d [SEP]` and fails its pairs."""
    r = rec(name)
    async with Session.open(str(DIR / f"{name}.gguf"), backend=backend, weight_cache=False) as s:
        if "scores" in r:
            assert [s.rerank_ids(QUERY, t) for t in r["texts"]] == r["pairs"]
            got = await s.rerank(QUERY, r["texts"])
            assert np.abs(np.array(got) - np.array(r["scores"])).max() < 1e-3, (got, r["scores"])
            return
        for pooling, want in r["embeddings"].items():
            got = np.asarray(await s.embed(r["texts"], normalize=False, pooling=pooling), np.float64)
            want = np.asarray(want, np.float64)
            cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            assert cos.min() >= 0.999, (pooling, cos)
