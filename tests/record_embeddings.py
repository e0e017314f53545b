"""Records llama.cpp's embeddings (llama-cpp-python, embedding=True) for tests/test_embed.py.
Run once per model with a Python that has llama-cpp-python (never a hearthlm dependency):

    /path/to/llcpp/bin/python tests/record_embeddings.py MODEL.gguf tests/data/embeddings_NAME.json
"""
import json
import sys

import llama_cpp

TEXTS = [
    "The hearth was the centre of the home.",
    "hello",
    "Embeddings map a text to a vector; similar texts land close together, which is what "
    "retrieval needs. This one is long enough to be computed in several chunks when the "
    "engine's token budget is small, so that pooling across steps is tested as well.",
    "def add(a, b):\n    return a + b\n",
]
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


def main(model: str, out: str) -> None:
    rec = {"llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "tokens": [], "pooling": {}}
    for name, kind in POOLING.items():
        llm = llama_cpp.Llama(model_path=model, embedding=True, pooling_type=kind, n_ctx=512, n_batch=512,
                              n_ubatch=512, verbose=False)
        if not rec["tokens"]:
            rec["tokens"] = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS]
        rec["pooling"][name] = [[round(float(x), 6) for x in llm.embed(t, normalize=False)] for t in TEXTS]
        llm.close()
    with open(out, "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
