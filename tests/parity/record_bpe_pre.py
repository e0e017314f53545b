"""Record llama.cpp's token ids for BPE pre-tokenizer types on a tiny vocabulary (CI never runs
llama.cpp):
    python tests/parity/record_bpe_pre.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
writes tests/data/bpe_pre_parity.json: {pre: [[text, ids], ...]}; tests/test_tokenizer.py compares."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from tiny_gguf import write_tiny  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "bpe_pre_parity.json"
PRES = ["gpt-4o"]
# merges that a split through "HelloWorld", a contraction or a digit group would keep from applying
MERGES = ("H e", "l l", "He ll", "Hell o", "W o", "r l", "Wo rl", "Worl d", "o W", "n '", "' t", "' T", "1 2",
          "12 3", "4 5", "45 6", "3 4", "a /", "/ b", "Ġ z", "Ġ Ġ", "Ã ©", "é t", "C a", "Ca f", "Caf é")
TEXTS = ["HelloWorld", "helloWorld HELLOworld", "don't DON'T Don'T", "12345678 1234", "a/b\n/c a/\n\nb",
         "ÉtéCafé naïveTEST", "x\r\n\ny  z   ", "  Hello World\t\tHELLO", "CamelCaseXMLParser's", "ǅungla ǈ"]
CODE = """import json, sys
from llama_cpp import Llama
jobs = json.loads(sys.argv[1])
out = {}
for pre, path in jobs.items():
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    out[pre] = [[t, llm.tokenize(t.encode(), add_bos=False, special=False)] for t in TEXTS]
print(json.dumps(out))
"""

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        jobs = {pre: str(write_tiny(Path(d) / f"{pre}.gguf", pre=pre, merges=MERGES)) for pre in PRES}
        code = f"TEXTS = {TEXTS!r}\n" + CODE
        res = subprocess.run([a.llama_python, "-c", code, json.dumps(jobs)], capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-4000:])
    OUT.write_text(json.dumps({"merges": MERGES, **json.loads(res.stdout)}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
