"""The host's memory read bandwidth, as the roofline of decoding: a token reads every weight
once, so tokens/s can be at most bandwidth / bytes read per token (`hearthlm bench`)."""
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np


def read_bandwidth(nbytes: int = 256 << 20, repeat: int = 5, threads: int | None = None) -> float:
    """Bytes/s of reading an array larger than the caches, a slice per thread (numba's count:
    the threads decoding uses); numpy's sum releases the GIL and runs at memory speed. The best
    of `repeat` passes: on a shared machine other processes only add noise."""
    n = threads or numba.get_num_threads()
    a = np.ones(nbytes // 8, np.uint64)
    parts = np.array_split(a, n)
    best = np.inf
    with ThreadPoolExecutor(n) as ex:
        for _ in range(repeat + 1):  # the first pass faults the pages in
            t = time.perf_counter()
            list(ex.map(np.add.reduce, parts))
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def read_bandwidth_apart(threads: int | None = None, repeat: int = 3) -> float:
    """read_bandwidth in a child process: its 256 MB array stays out of the caller's peak RSS."""
    import subprocess
    import sys
    n = threads or numba.get_num_threads()
    code = ("from hearthlm.backends.cpu.bandwidth import read_bandwidth as r; "
            f"print(r(repeat={int(repeat)}, threads={int(n)}))")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
