"""Record llama.cpp's token ids for Gemma 4's SPM-style BPE (tokenizer.ggml.model "gemma4") on a tiny
vocabulary (CI never runs llama.cpp):
    python tests/parity/record_gemma4_tokenizer.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
writes tests/data/gemma4_tokenizer.json (the vocabulary, merges and [text, ids] pairs with BOS)."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

OUT = Path(__file__).parent.parent / "data" / "gemma4_tokenizer.json"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn|>", "<|turn>"]
CHARS = list("▁abcdefghijklmnopqrstuvwxyzHTW.,!?'é\n") + ["\n\n", "\n\n\n"]  # no merge makes the last
MERGES = ["▁ t", "h e", "▁t he", "l l", "▁ w", "o r", "▁w or", "l d", "▁wor ld", "H e", "He ll", "Hell o",
          "▁ ▁", "e l", "▁ h", "▁h e", "\n \n"]
TEXTS = ["Hello world", "the world\n\nhello", "a\n\n\nb\nc", "Café ñ 日本", "  two  spaces", "ends with space ",
         "\n", "Hello<turn|>world", "x\n\n\n\n"]
CODE = """import json, sys
from llama_cpp import Llama
texts = json.loads(sys.argv[2])
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([[t, llm.tokenize(t.encode(), add_bos=True, special=True)] for t in texts]))
"""


def vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + CHARS
    tokens += [m.replace(" ", "") for m in MERGES if m.replace(" ", "") not in tokens]
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * (len(tokens) - len(SPECIALS) - 256)
    return tokens, types


def metadata() -> dict:
    tokens, types = vocab()
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": False}  # llama.cpp adds BOS for gemma4 all the same


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for k, v in {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
                     "attention.head_count": 2}.items():
            w.add_uint32(f"llama.{k}", v)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        md = metadata()
        w.add_tokenizer_model(md["tokenizer.ggml.model"])
        w.add_token_list(md["tokenizer.ggml.tokens"])
        w.add_token_types(md["tokenizer.ggml.token_type"])
        w.add_token_merges(md["tokenizer.ggml.merges"])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        res = subprocess.run([a.llama_python, "-c", CODE, str(path), json.dumps(TEXTS)], capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-4000:])
    OUT.write_text(json.dumps(json.loads(res.stdout), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
