"""`hearthlm bench --startup`: what a program that starts hearthlm per use feels. Each run is a
fresh Python process that imports the engine, opens the model and generates one token; the
parent times it from the moment it starts the process to the moment the child has the token,
and the child reports its peak RSS (VmHWM). llama-cpp-python (never a dependency) does the same in
fresh processes of the interpreter --llama-cpp-python names (llama_cpp_side.py --startup), in turn
with hearthlm's runs so that a noisy spell of a shared machine hits both; each figure is the median over --repeat runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

PROMPT = "The capital of France is"

# The children: each prints one JSON line {"t_token": wall clock at the token, "peak_rss_mb",
# "import_s", "open_s"}. time.time() (not perf_counter) is comparable across processes.
_HEARTHLM = r"""
import json, sys, time
t0 = time.time()
from hearthlm import SyncSession
t1 = time.time()
with SyncSession(sys.argv[1], n_ctx=int(sys.argv[2])) as s:
    t2 = time.time()
    s.generate(sys.argv[3], max_tokens=1, temperature=0)
    t3 = time.time()
    stats = s.stats()
print(json.dumps(dict(t_token=t3, import_s=t1 - t0, open_s=t2 - t1, first_token_s=t3 - t2,
                      peak_rss_mb=__import__("hearthlm.bench.startup").bench.startup.peak_rss_mb(),
                      weight_cache=stats.get("weight_cache"))))
"""

def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: starts afresh at exec), in MiB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_once(engine: str, path: str, n_ctx: int, env: dict | None = None, python: str | None = None) -> dict:
    """One fresh process of `engine` ("hearthlm" or "llama.cpp", the latter llama_cpp_side.py --startup
    in `python`): start to first token and its figures."""
    if engine == "hearthlm":
        cmd = [sys.executable, "-c", _HEARTHLM]
    else:
        from hearthlm.bench.yardstick import SIDE
        cmd = [python or sys.executable, str(SIDE), "--startup"]
    cpu0 = _children_cpu()
    t = time.time()
    r = subprocess.run([*cmd, path, str(n_ctx), PROMPT], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} startup run failed ({r.returncode}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["start_to_token_s"] = out.pop("t_token") - t
    out["cpu_s"] = _children_cpu() - cpu0  # less sensitive than wall time to a busy machine
    return out


def _children_cpu() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


KEYS = ("start_to_token_s", "cpu_s", "import_s", "open_s", "first_token_s", "peak_rss_mb")


def bench_startup(path: str, *, repeat: int = 5, n_ctx: int = 2048, python: str | None = None) -> list[dict]:
    """Rows: hearthlm's medians, llama.cpp's and their ratio (when `python`, an interpreter with
    llama-cpp-python, is given).
    One untimed run of each first: the page cache holds the model file, the packed-weight
    cache exists (a start after a fresh install is measured by `first_run`)."""
    engines = ["hearthlm"] + (["llama.cpp"] if python else [])
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for e in engines:
        run_once(e, path, n_ctx, python=python)
    for _ in range(repeat):
        for e in engines:
            runs[e].append(run_once(e, path, n_ctx, python=python))
    rows = [dict(engine=e, **{k: float(np.median([r[k] for r in runs[e]])) for k in KEYS}) for e in engines]
    if "weight_cache" in runs["hearthlm"][-1]:
        rows[0]["weight_cache"] = runs["hearthlm"][-1]["weight_cache"]
    if len(rows) == 2:
        rows.append(dict(engine="ratio", **{k: rows[0][k] / rows[1][k] for k in KEYS if rows[1][k]}))
    return rows


def first_run(path: str, n_ctx: int = 2048) -> dict:
    """A start as after a fresh install: numba's cache and the packed-weight cache empty (both
    pointed at a new temporary directory)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(d, "numba"), HEARTHLM_CACHE_DIR=os.path.join(d, "hl"))
        return run_once("hearthlm", path, n_ctx, env=env)


def print_rows(rows: list[dict], title: str) -> None:
    cols = ["engine", *KEYS]
    print(title)
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>16.3f}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>16}"
                        for c in cols))


async def _prepare(model: str, filename: str | None, say) -> None:
    import anyio

    from hearthlm.session import Session
    t0 = time.perf_counter()
    say("opening the model (weights packed into the cache the first time)")
    async with Session.open(model, filename=filename, n_ctx=1024) as s:
        prompt = s.tokenize("The hearth is where people gather ")
        steps = [("one request: a short prompt and decoding", [prompt], 4),
                 ("requests together: batched decoding", [prompt[:3], prompt[:5], prompt[:7]], 4),
                 ("a long prompt: prefill in chunks", [(prompt * 1000)[:min(600, s.n_ctx - 4)]], 2)]
        for what, prompts, n in steps:
            say(f"{time.perf_counter() - t0:6.1f} s  compiling kernels for {what}")
            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(lambda p=p: s.generate(p, max_tokens=n, temperature=0))
    say(f"{time.perf_counter() - t0:6.1f} s  done: later starts load these from the caches")


def prepare(model: str, filename: str | None = None, say=print) -> None:
    """What a first start after install does, as a step of its own with progress: compile the
    kernels a model needs into numba's cache and pack its weights into the weight cache."""
    import anyio
    anyio.run(_prepare, model, filename, say)
