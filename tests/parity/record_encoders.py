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
from llamacpp_eval import embedder as _llm  # noqa: E402
from llamacpp_eval import pair as _pair
from llamacpp_eval import pooled as _pooled

OUT = Path(__file__).parents[1] / "data" / "encoder_parity.json"


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
