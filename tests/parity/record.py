"""Record llama.cpp's outputs on the tiny models once (CI never runs llama.cpp):
    python tests/parity/record.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python [variant ...]
writes tests/data/arch_parity.json (the variants named, or all)."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from models import LLAMA_KW, N_STEPS, PROMPTS, VARIANTS, write  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "arch_parity.json"

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("variants", nargs="*")
    a = ap.parse_args()
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        jobs = [{"name": v, "path": str(write(Path(d) / f"{v}.gguf", v)), "prompts": PROMPTS, "n_steps": N_STEPS,
                 "kw": LLAMA_KW.get(v, {})} for v in (a.variants or VARIANTS)]
        res = subprocess.run([a.llama_python, str(Path(__file__).parent / "llamacpp_eval.py"), json.dumps(jobs)],
                             capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-4000:])
        data.update(json.loads(res.stdout))
    OUT.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    print(f"wrote {OUT}: {', '.join(sorted(data))}")
