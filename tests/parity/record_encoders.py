"""Records llama.cpp's view of the tiny encoders (tests/parity/encoders.py) into
tests/data/encoder_parity.json, once, under a Python that has llama-cpp-python 0.3.36 (never a
hearthlm dependency, never run in CI):

    .venv/bin/python tests/parity/record_encoders.py

Per variant: each text's token ids (add_special, as llama.cpp's embed tokenizes), its pooled
embedding alone and in one batch of all texts (different lengths in one decode: padding must
not leak), each pooling type the architecture has, and for the reranker the score of each
(query, document) pair as llama-server pairs them ([CLS] query [SEP] document)."""
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).parent))
from encoders import DOCS, QUERY, TEXTS, VARIANTS, write  # noqa: E402

POOL = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
        "last": llama_cpp.LLAMA_POOLING_TYPE_LAST, "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK}
OUT = Path(__file__).parents[1] / "data" / "encoder_parity.json"


def _llm(path, pooling):
    return llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=POOL[pooling], n_ctx=512, n_batch=512,
                           n_ubatch=512, n_seq_max=16, verbose=False)


def _pooled(llm, seqs):
    """Pooled outputs of token-id sequences decoded in one batch (llama-cpp-python's embed, on ids)."""
    llm._batch.reset()
    for i, ids in enumerate(seqs):
        llm._batch.add_sequence(ids, i, False)
    llm._ctx.kv_cache_clear()
    llm._ctx.decode(llm._batch)
    width = llama_cpp.llama_model_n_cls_out(llm.model) if llm.pooling_type() == POOL["rank"] else llm.n_embd()
    out = [[round(float(x), 6) for x in llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, i)[:width]]
           for i in range(len(seqs))]
    llm._batch.reset()
    return out


def _pair(llm, query: str, doc: str) -> list[int]:
    """llama-server's format_prompt_rerank, without a rerank template."""
    v = llama_cpp.llama_model_get_vocab(llm.model)
    eos = llama_cpp.llama_vocab_eos(v)
    eos = eos if eos >= 0 else llama_cpp.llama_vocab_sep(v)
    tok = lambda t: llm.tokenize(t.encode(), add_bos=False, special=False)  # noqa: E731
    add_eos = [eos] if llama_cpp.llama_vocab_get_add_eos(v) else []
    return ([llama_cpp.llama_vocab_bos(v)] if llama_cpp.llama_vocab_get_add_bos(v) else []) + tok(query) + add_eos \
        + ([llama_cpp.llama_vocab_sep(v)] if llama_cpp.llama_vocab_get_add_sep(v) else []) + tok(doc) + add_eos


def record(variant: str, tmp: Path) -> dict:
    path = write(tmp / f"{variant}.gguf", variant)
    rec = {"tokens": None, "pooling": {}, "batched": {}}
    for pooling in (("rank", "cls") if VARIANTS[variant][3] else ("mean", "cls", "last")):
        llm = _llm(path, pooling)
        if rec["tokens"] is None:
            rec["tokens"] = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS]
        if pooling == "rank":
            rec["pairs"] = [_pair(llm, QUERY, d) for d in DOCS]
        seqs = rec["pairs"] if pooling == "rank" else rec["tokens"]
        rec["pooling"][pooling] = [_pooled(llm, [s])[0] for s in seqs]
        rec["batched"][pooling] = _pooled(llm, seqs)
        llm.close()
    return rec


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data["llama_cpp_python"] = llama_cpp.__version__
    with tempfile.TemporaryDirectory() as d:
        for v in names:
            data[v] = record(v, Path(d))
    OUT.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print("wrote", OUT, names)
