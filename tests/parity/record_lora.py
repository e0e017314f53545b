"""Record llama.cpp's outputs with LoRA adapters on the tiny models once (CI never runs llama.cpp):
    python tests/parity/record_lora.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
writes tests/data/lora_parity.json: per case (BASES x CASES) the greedy steps and top-5 as
arch_parity.json's, with the adapters (hearthlm.bench.lora_files.write_lora, seeds as ADAPTERS) set."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hearthlm.bench.lora_files import write_lora

sys.path.insert(0, str(Path(__file__).parent))
from models import N_STEPS, PROMPTS, write  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "lora_parity.json"
BASES = ("llama", "qwen2", "gemma3")
# name -> write_lora's arguments: "b" has alpha 0 (the scale alone) and adapts the LM head too
ADAPTERS = {"a": dict(seed=1, rank=4, alpha=8.0), "b": dict(seed=2, rank=8, alpha=0.0, size=0.3, output=True)}
CASES = {"base": {}, "a": {"a": 1.0}, "a_half": {"a": 0.5}, "a_b": {"a": 1.0, "b": 0.5}}


def files(d: Path, base: str) -> tuple[Path, dict[str, Path]]:
    """The base model and its adapters, as the test writes them."""
    m = write(d / f"{base}.gguf", base)
    return m, {n: write_lora(d / f"{base}-{n}.lora.gguf", m, **kw) for n, kw in ADAPTERS.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        jobs = []
        for base in BASES:
            m, ads = files(Path(d), base)
            jobs += [{"name": f"{base}/{case}", "path": str(m), "prompts": PROMPTS, "n_steps": N_STEPS,
                      "kw": {"loras": [[str(ads[n]), s] for n, s in scales.items()]}} for case, scales in CASES.items()]
        res = subprocess.run([a.llama_python, str(Path(__file__).parent / "llamacpp_eval.py"), json.dumps(jobs)],
                             capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-4000:])
    OUT.write_text(json.dumps(dict(sorted(json.loads(res.stdout).items())), indent=1) + "\n")
    print(f"wrote {OUT}")
