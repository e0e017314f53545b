"""Encoders (bert, nomic-bert, jina-bert-v2) against llama.cpp: tiny random-weight models with a WordPiece
vocabulary (tests/parity/encoders.py), their tokens, pooled embeddings and reranker scores
recorded once with llama-cpp-python 0.3.36 (tests/parity/record_encoders.py). Criteria: token
ids exact; cosine >= 0.999 per text, alone and in one batch of texts of different lengths;
rerank scores within 1e-3."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, load_json

from hearthlm import ContextLengthError, InvalidRequestError, Session

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from encoders import DOCS, QUERY, TEXTS, VARIANTS, write  # noqa: E402

REC = load_json(DATA / "encoder_parity.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("encoders")
    return {v: str(write(d / f"{v}.gguf", v)) for v in VARIANTS}


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_matches_llama_cpp(files, variant):
    rec = REC[variant]
    async with Session.open(files[variant], weight_cache=False) as s:
        assert [s.tokenize(t, add_special=True) for t in TEXTS] == rec["tokens"]
        for pooling, want in rec["pooling"].items():
            if pooling == "rank":
                if "pairs" in rec:  # llama.cpp's pairing, token for token (jina's [SEP] between BPE halves)
                    assert [s.rerank_ids(QUERY, d) for d in DOCS] == rec["pairs"]
                got = await s.rerank(QUERY, DOCS)
                assert np.abs(np.array(got) - np.array(want)[:, 0]).max() < 1e-3, (got, want)
                assert np.abs(np.array(got) - np.array(rec["batched"]["rank"])[:, 0]).max() < 1e-3
                continue
            # one at a time, then all in one step (texts of 3 to 25 tokens: padding must not leak)
            alone = np.concatenate([await s.embed([ids], normalize=False, pooling=pooling) for ids in rec["tokens"]])
            together = await s.embed(rec["tokens"], normalize=False, pooling=pooling)
            assert cosines(alone, want).min() >= 0.999, (pooling, cosines(alone, want))
            assert cosines(together, rec["batched"][pooling]).min() >= 0.999
            assert cosines(alone, together).min() > 0.99999  # batching changes nothing (float rounding aside)
        if rec["pooling"].get("mean"):  # the default pooling is the file's, normalized by default
            e = await s.embed(TEXTS)
            assert np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
        assert s.stats()["kv_blocks_used"] == 0 and s.stats()["running_requests"] == 0


@pytest.mark.parametrize("variant", ["bert", "nomic-bert", "jina-bert-v2", "jina-bert-v2-reranker"])
def test_encoder_graph_fuses(files, variant):
    """Flash attention on the non-causal mask in every layer (jina-bert-v2's with ALiBi's max_bias
    8); nomic-bert's K RoPE into the cache and its SwiGLU as one op."""
    from hearthlm.core.graph import Op
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime import fusion
    from hearthlm.runtime.batch import BatchShape

    m = load_model(files[variant])
    try:
        g = fusion.fuse(m.build_graph(BatchShape(n_tokens=8, n_seqs=2, max_blocks=4, n_out=2, n_slots=64,
                                                 block_size=16, embd=True)))
        ops, n = [x.op for x in g.nodes], m.config.n_layer
        attn = [x for x in g.nodes if x.op is Op.ATTN]
        assert len(attn) == n and Op.KQ not in ops and all(not a.params["causal"] for a in attn)
        assert all(a.params["alibi"] == (8.0 if variant.startswith("jina") else 0.0) for a in attn)
        assert ops.count(Op.GLU) == (n if variant.startswith("jina") else 0)  # GEGLU, its biases between
        assert ops.count(Op.ROPE_SET_ROWS) == (n if variant == "nomic-bert" else 0)
        assert ops.count(Op.FFN_GLU) == (n if variant == "nomic-bert" else 0)
    finally:
        m.close()


def test_wordpiece_cases(files):
    """Cased vs uncased, accents, CJK and punctuation, as llama.cpp splits them (ids recorded)."""
    from hearthlm.model_zoo.tokenizer_wpm import split_words
    assert split_words("Café naïve, 中文!") == ["cafe", "naive", ",", "中", "文", "!"]
    assert split_words("Café naïve", lowercase=False, strip_accents=False) == ["Café", "naïve"]
    assert split_words("a\tb\u00a0c\x00d\u200be") == ["a", "b", "cde"]  # whitespace splits; controls (U+200B: Cf) vanish
    cased, uncased = REC["bert-cased"]["tokens"], REC["bert"]["tokens"]
    assert cased[0] != uncased[0]  # "The" is a word of its own only where case is kept


async def test_encoder_requests(files):
    """Generation is refused on an encoder; an input over the context is refused or truncated;
    embedding and reranking run beside each other; a model without a head does not rerank."""
    async with Session.open(files["bert-reranker"], n_ctx=32, weight_cache=False) as s:
        with pytest.raises(InvalidRequestError, match="encoder"):
            await s.generate("the hearth", max_tokens=4)
        long = " ".join(["warm"] * 40)
        with pytest.raises(ContextLengthError):
            await s.embed(long)
        cut = await s.embed(long, truncate=True, normalize=False)
        ids = s.tokenize(long, add_special=True)
        assert np.allclose(cut, await s.embed([ids[:31] + ids[-1:]], normalize=False), atol=1e-6)
        scores, embs = await asyncio.gather(s.rerank(QUERY, DOCS * 10), s.embed(TEXTS * 10))
        assert len(scores) == 40 and embs.shape == (70, 32)
        assert np.allclose(scores[:4], scores[4:8], atol=1e-6)
        with pytest.raises(InvalidRequestError):
            await s.rerank(QUERY, [])
    async with Session.open(files["bert"], weight_cache=False) as s:
        with pytest.raises(InvalidRequestError, match="classification head"):
            await s.rerank(QUERY, DOCS)


def test_sync_session_reranks(files):
    from hearthlm import SyncSession
    with SyncSession(files["bert-reranker"], weight_cache=False) as s:
        scores = s.rerank(QUERY, DOCS)
    assert np.abs(np.array(scores) - np.array(REC["bert-reranker"]["pooling"]["rank"])[:, 0]).max() < 1e-3


@pytest.mark.parametrize("tensor", ["blk.1.attn_output.bias", "token_types.weight", "blk.0.ffn_down.bias",
                                    "blk.0.ffn_up.weight"])
async def test_jina_missing_tensor_is_named(tmp_path, tensor):
    """Tensors jina-bert-v2 needs (llama.cpp's loader requires them; bert's biases and token types
    are optional) are refused at load, by name."""
    from hearthlm import ModelLoadError
    p = write(tmp_path / "jina.gguf", "jina-bert-v2", drop=tensor)
    with pytest.raises(ModelLoadError) as e:
        async with Session.open(str(p), backend="reference", weight_cache=False):
            pass
    assert tensor in str(e.value) and "missing" in str(e.value), str(e.value)
