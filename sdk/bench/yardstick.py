"""One yardstick for `hearthlm bench --compare-llama-cpp`: llama.cpp's side of every measurement
runs in the interpreter --llama-cpp-python names (default $HEARTHLM_LLAMA_CPP_PYTHON, else this
one if it imports llama_cpp), as one child process (llama_cpp_side.py, a JSON command a line),
and every report names the host (CPU model, the ISA flags that matter, load average at start
and end) and llama.cpp's build (llama_cpp.__version__, llama_print_system_info(), the interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hearthlm.core.errors import InvalidRequestError

ENV_PYTHON = "HEARTHLM_LLAMA_CPP_PYTHON"
SIDE = Path(__file__).with_name("llama_cpp_side.py")
NO_INTERPRETER = f"no interpreter with llama-cpp-python (--llama-cpp-python or ${ENV_PYTHON}); skipping the comparison"
ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_facts() -> dict:
    """/proc/cpuinfo's model name and which of the ISA flags the kernels care about it lists."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name") and model == "unknown CPU":
                    model = ln.split(":", 1)[1].strip()
                elif ln.startswith("flags") and not flags:
                    flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return dict(cpu=model, isa=[f for f in ISA if f in flags], cores=len(os.sched_getaffinity(0)))


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def interpreter(a, *, module: str = "llama_cpp") -> str | None:
    """The interpreter for llama.cpp's side: --llama-cpp-python, else $HEARTHLM_LLAMA_CPP_PYTHON
    (either must import `module`, or a one-line error names it), else this one if it imports it,
    else None (no comparison)."""
    named = getattr(a, "llama_cpp_python", None) or os.environ.get(ENV_PYTHON)
    if named:
        why = _broken(named, module)
        if why:
            src = "--llama-cpp-python" if getattr(a, "llama_cpp_python", None) else f"${ENV_PYTHON}"
            raise InvalidRequestError(f"{src} {named}: {why}")
        return named
    return sys.executable if not _broken(sys.executable, module) else None


def _broken(python: str, module: str) -> str | None:
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return "no such executable"
    try:
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        return f"cannot run it ({e.strerror})"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[-1]
        return f"cannot import {module} ({last})"
    return None


class LlamaCppSide:
    """llama_cpp_side.py in `python`; `.build` its first answer; `ask(op, **kw)` one command."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.err = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen([python, str(SIDE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True)
        self.build = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.err.seek(0)
            tail = self.err.read()[-2000:]
            raise RuntimeError(f"llama.cpp's side ({self.python}) stopped ({self.p.wait()}): {tail}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"llama.cpp's side ({self.python}): {out['error']}")
        return out

    def ask(self, op: str, **kw) -> dict:
        self.p.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Report:
    """The host and build facts of one bench run: made before measuring, `build` set by whoever
    starts llama.cpp's side, `end()` after."""

    def __init__(self) -> None:
        self.facts = dict(host=cpu_facts(), load_start=load_average())
        self.build: dict | None = None

    def end(self) -> dict:
        self.facts.update(load_end=load_average(), llama_cpp=self.build)
        return self.facts


def header_lines(facts: dict) -> list[str]:
    """The report's lines naming the host and the build (table output)."""
    h = facts["host"]
    lines = [f"cpu: {h['cpu']}, {h['cores']} cores, {' '.join(h['isa']) or 'no AVX2'}"
             + ("" if any(f.startswith("amx") for f in h["isa"]) else " (no amx)")
             + f"  load average {_load(facts.get('load_start'))} at start, {_load(facts.get('load_end'))} at end"]
    busy = max((x[0] for x in (facts.get("load_start"), facts.get("load_end")) if x), default=0.0)
    if busy >= h["cores"]:  # measured here: llama.cpp's 2 OpenMP threads 5-6x slower than its 1 at load 7 on 2 cores
        lines.append(f"busy host: 1-minute load {busy:.2f} on {h['cores']} cores; figures (llama.cpp's spinning "
                     "threads above all) are not comparable with a quiet run's")
    if facts.get("read_bandwidth_gb_s"):
        lines.append(f"read bandwidth: {facts['read_bandwidth_gb_s']:.1f} GB/s ({facts['bandwidth_threads']} threads)")
    b = facts.get("llama_cpp")
    if b:
        lines.append(f"llama.cpp: llama-cpp-python {b['llama_cpp_python']} in {b['python']}: {b['system_info']}")
    return lines


def _load(x) -> str:
    return "/".join(f"{v:.2f}" for v in x) if x else "n/a"
