"""The CPU kernels give the same bits whether a process compiled them or loaded them from numba's
cache, and on one thread or all (ops._JIT_ORDERED): two fresh processes over one empty
NUMBA_CACHE_DIR run tests/kernel_bits.py, the first compiling every float kernel, the second
loading them. Outputs that moved with the cache's state once moved Gemma 3's cpu golden by 0.11 nat
(0.29 off llama.cpp in a clean clone's run, 0.18 on a warm machine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_BITS = Path(__file__).parent / "kernel_bits.py"


def _run(env: dict, args: list[str]) -> dict:
    r = subprocess.run([sys.executable, str(KERNEL_BITS), *args], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--light"], pytest.param([], marks=pytest.mark.long)], ids=["light", "all"])
def test_kernels_give_the_same_bits_compiled_or_loaded_from_the_cache(tmp_path, args):
    """Mutation: ops._JIT_ORDERED's fastmath back to True (reassociation) fails it on "glu gelu"
    (the GELU's products ordered differently in the compiled and the cached copy), light or all;
    attention's context split by the thread count (32 positions a part on 2 threads) fails "all" on
    one thread (attention's 74 s of compiling is `make test-long`'s; in `make test` the same
    mutation fails tests/test_invariance_real.py)."""
    # two threads whatever the machine (or a taskset) offers: the one-thread pass then differs in count
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), NUMBA_NUM_THREADS="2")
    cold, warm = _run(env, args), _run(env, args)
    assert cold["compiled"] > 0 and cold["loaded"] == 0, cold  # what each process did
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"], warm
    moved = [k for k in cold["bits"] if cold["bits"][k] != warm["bits"][k]]
    assert not moved, f"compiled and cached kernels differ: {moved}"
    assert cold["threads"] == 2, cold["threads"]
    threads = [k for k in cold["bits"] if cold["bits"][k] != cold["bits_1_thread"][k]]
    assert not threads, f"one thread and all differ: {threads}"
