"""The application's event loop never stalls: a 10 ms ticker on asyncio keeps its largest
gap under 50 ms while a 200,000-character prompt is tokenized, a 2,000-message chat is
rendered, and 32 generations run at once (on the real SmolLM2 model); on a quiet machine, and
beside a CPU-bound process at normal priority (an app's own work competing for the cores).

A gap is counted less the time the hypervisor took from the virtual machine's cores meanwhile
(steal, /proc/stat): with both cores busy (the competitor and the engine), the 2-core CI machine
has a core taken for ~100 ms every few seconds, which stalls whichever thread was on it (measured
at stop 56: each 101-111 ms gap came with 10 ticks of steal, the loop thread neither running nor
waiting for the core; none without). A phase whose gap is over the bound runs once more, and
fails if it is over again: in two full-suite runs (not alone, where it stays at 15-20 ms) the
200,000-character prompt's gap was 50.6 and 59.5 ms once, with no steal, cause not found.

Mutations seen to fail: prompts prepared on the loop (`if False:` for `if big:` in
Session._prompt_ids_off_loop): on the quiet machine, gaps of 108 then 88 ms (the
200,000-character prompt) and 207 then 206 ms (the 2,000-message chat)."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from hearthlm import ContextLengthError, Session

MAX_GAP = 0.050


_STAT: list[int] = []  # /proc/stat, kept open: a tick reads it with one pread


def stolen() -> list[float]:
    """Seconds of steal so far on each core (0 where /proc/stat is absent). One system call a
    tick (pread on a kept descriptor), not open, reads and close: each of those gives up the GIL
    and waits up to a switch interval (5 ms) to take it back while a worker thread computes,
    which the next gap counted as the loop's stall (a tick cost 10-20 ms that way)."""
    try:
        if not _STAT:
            _STAT.append(os.open("/proc/stat", os.O_RDONLY))
        text = os.pread(_STAT[0], 1 << 16, 0).decode()
        rows = [ln.split() for ln in text.splitlines() if ln.startswith("cpu") and ln[3].isdigit()]
    except OSError:
        return [0.0]
    hz = os.sysconf("SC_CLK_TCK")
    return [int(r[8]) / hz for r in rows]


class Ticker:
    """Ticks every 10 ms on the running loop; `gap` is the longest time between two ticks, less
    the most any one core was stolen meanwhile (the thread that stalled was on one of them);
    `raw` the longest without that."""

    def __init__(self) -> None:
        self.gap = self.raw = 0.0
        self._task, self.last, self.steal = None, time.perf_counter(), stolen()

    def _tick(self) -> None:
        now, steal = time.perf_counter(), stolen()
        taken = max((b - a for a, b in zip(self.steal, steal)), default=0.0)
        self.gap, self.raw = max(self.gap, now - self.last - taken), max(self.raw, now - self.last)
        self.last, self.steal = now, steal

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.010)
            self._tick()

    async def __aenter__(self) -> "Ticker":
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0.02)
        self.gap = self.raw = 0.0
        return self

    async def __aexit__(self, *exc) -> None:
        self._tick()  # a stall that lasted to the end counts too
        self._task.cancel()


@pytest.fixture(params=["quiet", "competitor"])
def machine(request):
    if request.param == "quiet":
        yield request.param
        return
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield request.param
    finally:
        p.kill()
        p.wait()


async def ticking(work, tries: int = 2) -> list[tuple[float, float]]:
    """(gap less steal, raw gap) of each run of `work` under a Ticker, run again while over the
    bound, `tries` times at most. Work on the loop stalls it every time; what stalled it once only
    was not the loop's work (see the module's docstring)."""
    runs = []
    for _ in range(tries):
        async with Ticker() as t:
            await work()
        runs.append((t.gap, t.raw))
        if t.gap < MAX_GAP:
            break
    return runs


async def test_loop_keeps_ticking(smollm2_path, machine):
    async with Session.open(str(smollm2_path), n_ctx=8192) as s:  # 200,000 characters pass its length check
        # steady state: the batch shapes built and numba's kernels loaded (a first load holds the
        # GIL, once per process) before the ticker starts
        await asyncio.gather(*(s.generate(f"Warm {i}:", max_tokens=16, temperature=0.7, seed=i) for i in range(32)))

        async def long_prompt():
            with pytest.raises(ContextLengthError):  # tokenized in full (the loop ticking), then too long
                await s.generate("the hearth and the home " * 8334, max_tokens=1)

        async def long_chat():
            msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(2000)]
            with pytest.raises(ContextLengthError):
                await s.generate(messages=msgs, max_tokens=1)

        async def generations():
            outs = await asyncio.gather(*(s.generate(f"Story {i}:", max_tokens=16, temperature=0.7, seed=i)
                                          for i in range(32)))
            assert all(o.token_ids for o in outs)

        runs = {"200,000-character prompt": await ticking(long_prompt),
                "2,000-message chat": await ticking(long_chat),
                "32 concurrent generations": await ticking(generations)}
        print("largest ticker gaps, less steal (raw), by run:",
              {k: [f"{g * 1e3:.1f} ms ({r * 1e3:.1f})" for g, r in v] for k, v in runs.items()})
        # for a failure's report: threads left by earlier tests also take turns at the GIL
        print("threads:", sorted(t.name for t in threading.enumerate()))
        assert all(v[-1][0] < MAX_GAP for v in runs.values()), runs
