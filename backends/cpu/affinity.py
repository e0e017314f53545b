"""Moving the engine's OpenMP workers off a core they share with it (Linux).

A worker sleeps between steps and the kernel wakes it on a core of its choosing. Beside another
busy process (even at nice 19) it can wake on the engine thread's own core, the other core
counting as busy: the two then take turns on one core while each parallel kernel waits for
both, and a 5 ms step takes 60 ms. The pair stays so, as each wake goes back to the core the
worker slept on. Measured on 2 cores beside one spinning process. After a slow step, a worker
found on a core with another of the engine's threads is pinned to a core with none until it has
woken there once, then given its own mask back (the kernel keeps it where it is). Once that has
happened, each step on several threads pins the workers apart while it runs (a few syscalls),
as a worker woken beside a busy process lands stacked as often as not; between steps they have
their own masks. Those per-step pins go by the workers' cores as last read (REFRESH), where the
engine thread's is its own sched_getcpu: reading /proc/self/task/<tid>/stat took 190-210 us a
thread on a 2-core Zen 3 VM while the worker spun (28 us idle), 0.3-0.4 ms of each 6-7 ms
SmolLM2 decode step."""
from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
from numba import types

_gettid = types.ExternalFunction("gettid", types.int32())  # by name, so the kernel caches


@numba.njit(parallel=True, cache=True)
def _team_tids(out):
    for _i in numba.prange(out.shape[0]):  # an iteration a thread (a static schedule)
        out[numba.get_thread_id()] = _gettid()


def supported() -> bool:
    try:
        ctypes.CDLL(None).gettid  # noqa: B018 (glibc >= 2.30 has it)
    except (AttributeError, OSError):
        return False
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


REFRESH = 32  # per-step pins between two reads of the workers' cores from /proc


def _libc_getcpu():
    try:
        f = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    f.restype = ctypes.c_int
    return f


_getcpu = _libc_getcpu()


def current_cpu() -> int | None:
    """The core the calling thread runs on (glibc's sched_getcpu), or None."""
    c = _getcpu() if _getcpu is not None else -1
    return c if c >= 0 else None


def cpu_of(tid: int) -> int | None:
    """The core a thread of this process last ran on."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[36])  # field 39, "processor"


class Spreader:
    """One per engine thread (OpenMP gives each thread that starts parallel work its own team)."""

    def __init__(self) -> None:
        self.team: list[int] = []  # the calling thread, then its workers, at the current count
        self.pinned: dict[int, set[int]] = {}  # worker -> its own mask, while pinned
        self.moves = 0
        self.cores: list[int | None] | None = None  # the team's cores as the last spread left them
        self._reuse = 0  # per-step pins left before the workers' cores are read again
        self.reads = 0  # reads of the team's cores from /proc

    def _team(self) -> list[int]:
        n = numba.get_num_threads()
        if len(self.team) != n:
            out = np.zeros(n, np.int64)
            for _ in range(10):
                _team_tids(out)
                if (out != 0).all():
                    break
            self.team = [int(t) for t in out]
        return self.team

    def release(self) -> None:
        """After a step on the workers: the pinned ones have woken where they were sent."""
        for tid, mask in self.pinned.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass
        self.pinned = {}

    def spread(self, every: bool = False) -> bool:
        """Pins each worker that shares a core with an earlier one of the team to a free core of
        its mask (every: each worker, to its own core when that is free, so that waking it cannot
        stack it); True if any was pinned."""
        team = self._team()
        if every and self._reuse > 0 and self.cores is not None and len(self.cores) == len(team):
            self._reuse -= 1  # the workers where the last spread put them; this thread where it is now
            me = current_cpu()
            cores = [cpu_of(team[0]) if me is None else me, *self.cores[1:]]
        else:
            cores = [cpu_of(t) for t in team]
            self._reuse, self.reads = REFRESH, self.reads + 1
        taken = {cores[0]}
        placed = [cores[0]]
        moved = False
        for tid, core in zip(team[1:], cores[1:]):
            if core is None:
                placed.append(None)
                continue
            if core in taken or every:
                try:
                    mask = self.pinned.get(tid) or os.sched_getaffinity(tid)
                    free = [core] if core not in taken else sorted(mask - taken - set(cores))
                    if free and free[0] in mask:
                        os.sched_setaffinity(tid, {free[0]})
                        self.pinned.setdefault(tid, mask)
                        moved |= free[0] != core
                        core = free[0]
                except OSError:  # the thread is gone, or the mask is not ours to change
                    pass
            taken.add(core)
            placed.append(core)
        self.cores = placed
        self.moves += moved
        return moved
