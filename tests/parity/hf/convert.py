"""Converts the tiny Hugging Face checkpoints (make.py) with llama.cpp's own convert_hf_to_gguf.py, as
users' files are made. Run under a venv with llama.cpp's conversion requirements (torch, transformers
4.57.6, sentencepiece) and llama-cpp-python 0.3.36's source tree (never in CI):

    python tests/parity/hf/convert.py --llama-cpp DIR/vendor/llama.cpp HF_DIR [name ...]

writes tests/data/converted/<name>.gguf (F32), and for a vision model (a spec's convert_args_mmproj) its
<name>.mmproj.gguf from a second pass (F32 but what the converter forces: Gemma 3's projector matrix is F16).
One shim: the converter names a BPE pre-tokenizer by hashing what a known model's tokenizer makes of a test
string, and our tiny vocabularies match none; an unknown hash is given the name the spec says (the real
family's), nothing else is touched."""
import argparse
import json
import runpy
import sys
from pathlib import Path

OUT = Path(__file__).parents[2] / "data" / "converted"

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, type=Path)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    sys.path[:0] = [str(a.llama_cpp), str(a.llama_cpp / "gguf-py")]
    from conversion import base  # noqa: E402

    original = base.TextModel.get_vocab_base_pre
    pre_name = {}

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return pre_name["pre"]

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    names = a.names or sorted(p.name for p in a.hf_dir.iterdir() if (p / "config.json").exists())
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        src = a.hf_dir / name
        spec = json.loads((src / "hearthlm_spec.json").read_text())
        pre_name["pre"] = spec.get("pre", "default")
        out = OUT / spec.get("folder", "")  # drafts/: draft models that run on a target (no references of their own)
        out.mkdir(exist_ok=True)
        passes = [(f"{name}.gguf", spec.get("convert_args", []))]  # the options a family's users convert with
        if spec.get("convert_args_mmproj") is not None:  # a vision model: its mmproj file from a second pass
            passes.append((f"{name}.mmproj.gguf", spec["convert_args_mmproj"]))
        for fname, args in passes:
            sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", "f32", "--outfile", str(out / fname), *args]
            try:
                runpy.run_path(str(a.llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
            except SystemExit as e:
                if e.code:
                    raise
            print("converted", fname, (out / fname).stat().st_size, "bytes")
