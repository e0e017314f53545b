"""Records llama.cpp's outputs on the converted test models (tests/data/converted/*.gguf) once, under
the interpreter of llama-cpp-python 0.3.36 (../shared/tools/llama-cpp-build.sh; never in CI):

    /tmp/lcp-venv/bin/python tests/parity/hf/record.py [name ...]

writes tests/data/converted/<name>.json: the token ids of TEXTS as llama.cpp tokenizes them (with and
without its special tokens, and with special-token text parsed), then for a decoder the greedy steps
with top-5 log-probs from each text's ids (and the ids its samplers suppress, where the file names
some), for an encoder each text's pooled embedding and, where the file has a rank head, the rerank
pairs as llama-server builds them and their scores."""
import ctypes
import json
import sys
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).parents[1]))
from llamacpp_eval import embedder, pair, pooled, run  # noqa: E402

DIR = Path(__file__).parents[2] / "data" / "converted"
TEXTS = ["The hearth is warm.", "Hello world!  Numbers 12345 and caf\u00e9 na\u00efve.", "search the vector index",
         "\u4e2d\u6587 \U0001F525 tabs\tand\nnew lines", "def main():\n    return [1, 2]"]
QUERY = "what is warm?"
N_STEPS = 12


def record(path: Path) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    specials = [llm.detokenize([t], special=True).decode("utf-8", "replace")
                for t in (llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab),
                          llama_cpp.llama_vocab_sep(vocab)) if t >= 0]
    marked = " x ".join(specials) + " end"  # special-token text, parsed when special=True
    rec = {"texts": TEXTS, "marked": marked,
           "tokens": {"plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in TEXTS],
                      "add_special": [llm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS],
                      "parse_special": llm.tokenize(marked.encode(), add_bos=False, special=True)},
           "flags": {k: bool(getattr(llama_cpp, f"llama_vocab_get_add_{k}")(vocab)) for k in ("bos", "eos", "sep")}}
    n = ctypes.c_int32(0)  # the ids its samplers ban (tokenizer.ggml.suppress_tokens, those in the vocabulary)
    ids = llama_cpp.llama_vocab_get_suppress_tokens(vocab, ctypes.byref(n))
    if n.value:
        rec["suppress_tokens"] = [int(ids[i]) for i in range(n.value)]
    md = {str(k).split(".", 1)[-1]: str(v).lower() for k, v in llm.metadata.items()}
    llm.close()
    pooling = md.get("pooling_type")
    if pooling is None and md.get("attention.causal") != "false":  # a decoder: greedy steps from each text's ids
        rec["greedy"] = run(str(path), rec["tokens"]["add_special"], N_STEPS)
        return rec
    # a cross-encoder's file names no pooling (llama.cpp is told --pooling rank); its labels mark it
    probe = llama_cpp.Llama(model_path=str(path), embedding=True, verbose=False)
    labelled = llama_cpp.llama_model_cls_label(probe.model, 0) is not None
    probe.close()
    kind = {"1": "mean", "2": "cls", "3": "last", "4": "rank"}.get(pooling, "rank" if labelled else "mean")
    emb = embedder(path, kind)
    if kind == "rank":  # llama-server's pairs of the query with each text
        rec["pairs"] = [pair(emb, QUERY, t) for t in TEXTS]
        rec["scores"] = [pooled(emb, [p])[0][0] for p in rec["pairs"]]
    else:
        rec["embeddings"] = {kind: [pooled(emb, [t])[0] for t in rec["tokens"]["add_special"]]}
    emb.close()
    return rec

if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in DIR.glob("*.gguf") if not p.stem.endswith(".mmproj"))
    for n in names:
        out = DIR / f"{n}.json"
        out.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, **record(DIR / f"{n}.gguf")},
                                  separators=(",", ":")) + "\n")
        print("recorded", out)
