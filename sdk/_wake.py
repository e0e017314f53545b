"""Delivery of engine events to the event loop without blocking the engine thread.
anyio has no non-blocking "call soon from a foreign thread", so we use the running
loop's own: asyncio's call_soon_threadsafe or trio's TrioToken.run_sync_soon."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import anyio
import sniffio


def loop_waker() -> Callable[[Callable[[], None]], None]:
    """Call on the event loop; returns `wake(fn)` that runs fn on that loop, from any thread."""
    lib = sniffio.current_async_library()
    if lib == "asyncio":
        import asyncio
        loop = asyncio.get_running_loop()
        call = loop.call_soon_threadsafe
    elif lib == "trio":
        import trio
        call = trio.lowlevel.current_trio_token().run_sync_soon
    else:
        raise RuntimeError(f"unsupported async library {lib!r}")

    def wake(fn: Callable[[], None]) -> None:
        try:
            call(fn)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
    return wake


class Channel:
    """Engine thread puts, one task on the loop takes. FIFO, unbounded (one request's tokens)."""

    def __init__(self, wake: Callable[[Callable[[], None]], None]) -> None:
        self._items: deque[Any] = deque()
        self._wake = wake
        self._event = anyio.Event()

    def put(self, item: Any) -> None:  # any thread
        self._items.append(item)
        self._wake(self._set)

    def _set(self) -> None:
        self._event.set()

    async def get_all(self) -> list[Any]:
        """Everything queued so far, waiting for at least one item."""
        while not self._items:
            self._event = anyio.Event()
            if self._items:  # arrived between the check and the new event
                break
            await self._event.wait()
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        return out
