"""Record llama.cpp's greedy outputs on the three real models, quantized files as they are, with the
shared build on a CPU without AVX-512 (tests/data/golden_avx2.json): the goldens' cases (same
prompt ids), 32 greedy steps, each step's top-5 log-probs. The goldens (tests/data/*.visible.json)
came from llama.cpp's AVX-512 build, and its AVX2 build rounds differently: on a 2-core Zen 3
(2026-12-07) SmolLM2 case 2 step 9's top token read -0.620 nat in llama.cpp's AVX2 run against
-0.410 in the AVX-512 record (ours, AVX2 kernels: -0.668; the golden's tolerance is 0.25). So where the kernels
compile without AVX-512 (tests/golden.py: `avx2_record`), the quantized record compared is this
one. Once, with llama-cpp-python (an oracle, never a dependency), on such a host, from the repo root:
  .venv/bin/python tests/parity/record_avx2.py --llama-python /tmp/lcp-venv/bin/python
(`../shared/tools/llama-cpp-build.sh` builds that interpreter; without AVX-512 on the CPU, its
build has none)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from record_dequantized import DATA, GOLDEN

HERE = Path(__file__).resolve().parent


def llama_side(jobs: list[dict]) -> dict:
    """Under the llama-cpp-python interpreter: record_dequantized's greedy steps, on a build
    without AVX-512 only."""
    import llama_cpp
    from record_dequantized import llama_side as greedy_steps
    info = llama_cpp.llama_print_system_info().decode()
    if "AVX512 = 1" in info:
        sys.exit(f"this llama.cpp build has AVX-512 ({info}): record on a CPU without it")
    return {**greedy_steps(jobs), "system_info": info}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python")
    ap.add_argument("--eval", help=argparse.SUPPRESS)  # the llama-cpp-python side: a jobs file
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    if a.eval:
        print(json.dumps(llama_side(json.loads(Path(a.eval).read_text()))))
        sys.exit()
    sys.path.insert(0, str(HERE.parent))
    from conftest import _model
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    with tempfile.TemporaryDirectory() as d:
        jobs = [{"name": name, "path": str(_model(name)),
                 "prompts": [c["prompt_ids"] for c in json.loads((DATA / f).read_text())["cases"]]}
                for name, f in GOLDEN.items()]
        (Path(d) / "jobs.json").write_text(json.dumps(jobs))
        res = subprocess.run([a.llama_python, __file__, "--eval", str(Path(d) / "jobs.json")],
                             stdout=subprocess.PIPE, text=True, check=True)
    out = json.loads(res.stdout)
    out["how"] = (f"llama.cpp's AVX2 build (no AVX-512) on {cpu}, the quantized files as they are, n_ctx 1024, "
                  "2 threads, K/V f16; the goldens' prompt ids")
    path = DATA / "golden_avx2.json"
    path.write_text(json.dumps(out) + "\n")
    print("wrote", path)
