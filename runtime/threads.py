"""How many worker threads the engine's steps run on, chosen by measuring. On a CPU shared
with other work (inside an app it is), a parallel kernel waits at its end for every worker,
and a worker descheduled by another process stalls it: fewer threads than cores can be
several times faster then, and slower again once the other work stops. So each step shape
keeps a running mean of its step time per thread count; steps run on the fastest, and now
and then one runs on another, to notice when the machine has changed. A change of the fastest
is often brief (a few slow steps while the kernel places a newcomer), so the first tries come
soon after it and then ever more rarely.

Except for long steps (a prefill, many rows) while all the threads are the fastest: there a try
of fewer would add most of a step to one request's latency (a 512-token prefill of Gemma 3: 0.47
-> 0.82 s), so they run on all the threads until something says the machine has changed: one
of their steps much slower than its mean, or a shorter shape (decode: many cheap steps, tried
as above) finding fewer threads faster."""
from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.3        # weight of the newest step in a running mean: a competitor shows within a few steps
FIRST_EVERY = 4    # steps between tries of another count, times how much slower it was (so a try costs
EXPLORE_EVERY = 32  # ~1/FIRST_EVERY of the time just after the fastest changed, halving with each try
                   # that confirms it, down to ~1/EXPLORE_EVERY), and at most MAX_EVERY
MAX_EVERY = 128
SLOW = 2.0         # a step this many times its count's mean is reported slow (done's return)
LONG_STEP = 0.1    # s: a shape whose steps take this long on all threads is tried on fewer only on evidence
CONTENDED = 1.3    # ... such as one of its steps taking this many times its mean


@dataclass
class _Shape:
    mean: dict[int, float] = field(default_factory=dict)  # thread count -> running mean of its step time (s)
    steps: int = 0
    next_try: int = 0  # step number at which another count is tried
    every: int = FIRST_EVERY  # the current spacing of tries (times the slowdown)
    best: int | None = None  # the fastest count when last tried
    warm: bool = False
    contended: bool = False  # its last step on all threads took CONTENDED times their mean


class ThreadTuner:
    """`pick(key)` before a step, `done(key, n, seconds)` after it. counts: the choices, the
    first preferred while nothing is measured."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts = counts
        self.shapes: dict[object, _Shape] = {}
        self.switches = 0  # steps whose count differed from the previous step's
        self._last = counts[0] if counts else None

    def pick(self, key) -> int | None:
        if len(self.counts) < 2:
            return self._last
        s = self.shapes.setdefault(key, _Shape())
        if self._settled(s):
            return max(self.counts)
        unmeasured = [n for n in self.counts if n not in s.mean]
        if unmeasured:
            return unmeasured[0]
        best = min(s.mean, key=s.mean.get)
        if s.steps >= s.next_try or s.contended and best == max(self.counts):  # try the runner-up
            return min((n for n in self.counts if n != best), key=s.mean.get)
        return best

    def _settled(self, s: _Shape) -> bool:
        """A long shape fastest on all the threads, with nothing saying the machine changed."""
        top = max(self.counts)
        t = s.mean.get(top)
        if t is None or t < LONG_STEP or s.contended or any(v < t for v in s.mean.values()):
            return False
        return all(min(o.mean, key=o.mean.get) == top for o in self.shapes.values() if len(o.mean) > 1)

    def done(self, key, n: int | None, seconds: float) -> bool:
        """Records a step; True if it ran on several threads and took SLOW times its count's
        mean (a worker descheduled, or placed on a busy core)."""
        if n is None or len(self.counts) < 2:
            return False
        if n != self._last:
            self.switches += 1
        self._last = n
        s = self.shapes[key]
        if not s.warm:  # a shape's first run loads its kernels: not a measure of the threads
            s.warm = True
            return False
        tried = s.steps >= s.next_try and not self._settled(s)
        old = s.mean.get(n)
        s.contended = n == max(self.counts) and old is not None and LONG_STEP <= old < seconds / CONTENDED
        # a try's one measurement replaces its count's mean: that mean is old, and may be of
        # another machine state (a competitor since gone)
        s.mean[n] = seconds if old is None or tried else (1 - ALPHA) * old + ALPHA * seconds
        s.steps += 1
        best = min(s.mean, key=s.mean.get)
        if best != s.best:  # the fastest changed (or a try was due): look again soon
            s.best, s.every, tried = best, FIRST_EVERY, True
        elif tried:
            s.every = min(2 * s.every, EXPLORE_EVERY)
        if tried:
            ratio = max(s.mean.values()) / max(min(s.mean.values()), 1e-9)
            s.next_try = s.steps + min(int(s.every * ratio), MAX_EVERY)
        return n > 1 and old is not None and seconds > SLOW * old

    def moved(self) -> None:
        """The backend moved its workers (runtime.engine, after a slow step): the means of
        several threads were of the old placement, so every shape measures them again next."""
        for s in self.shapes.values():
            s.mean = {n: t for n, t in s.mean.items() if n == 1}

    def current(self) -> int | None:
        return self._last
