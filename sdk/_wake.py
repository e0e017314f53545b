"""Delivery of engine events to the event loop without blocking the engine thread.
anyio has no non-blocking "call soon from a foreign thread", so we use the running
loop's own: asyncio's call_soon_threadsafe or trio's TrioToken.run_sync_soon.
A thread that delivers in rounds (the engine thread: a step's tokens for every request) holds
its wake-ups until `flush` ends the round: each wake-up is a write to the loop's socket that
lets the loop take the GIL, and sent token by token they made the engine and the loop take
turns at it many times a step."""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable

import anyio
import sniffio

_wakers: "weakref.WeakKeyDictionary[Any, _Waker]" = weakref.WeakKeyDictionary()
_local = threading.local()  # .held: channels put to since this thread's last flush (only once it has flushed)


def flush() -> None:
    """Ends a round of puts on this thread: the wake-ups held since the last call go out, one per
    loop. From its first call on, this thread holds its wake-ups until the next call, so a thread
    that calls it must call it after every round of puts (the engine: after each step's callbacks)."""
    held, _local.held = getattr(_local, "held", None), []
    by_waker: dict[int, tuple[_Waker, list[Channel]]] = {}
    for ch in held or ():
        by_waker.setdefault(id(ch._waker), (ch._waker, []))[1].append(ch)
    for w, chans in by_waker.values():
        w.notify(*chans)


class _Waker:
    """One loop's wake-ups from the engine thread, batched: the channels that got items since
    the last wake-up are set in one call on the loop, so a step's tokens for many requests
    cost the loop (and the engine thread) one cross-thread call, not one per token."""

    def __init__(self, call: Callable[[Callable[[], None]], Any]) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._dirty: list[Channel] = []

    def notify(self, *chans: "Channel") -> None:  # any thread
        with self._lock:
            self._dirty.extend(chans)
            if len(self._dirty) > len(chans):  # a wake-up is on its way, and will see these
                return
        try:
            self._call(self._run)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._dirty = []

    def _run(self) -> None:  # on the loop
        with self._lock:
            chans, self._dirty = self._dirty, []
        for ch in chans:
            ch._set()


def loop_waker() -> _Waker:
    """Call on the event loop; returns the waker that reaches that loop from any thread."""
    lib = sniffio.current_async_library()
    if lib == "asyncio":
        import asyncio
        loop = asyncio.get_running_loop()
        key, call = loop, loop.call_soon_threadsafe
    elif lib == "trio":
        import trio
        token = trio.lowlevel.current_trio_token()
        key, call = token, token.run_sync_soon
    else:
        raise RuntimeError(f"unsupported async library {lib!r}")
    w = _wakers.get(key)
    if w is None:
        w = _wakers[key] = _Waker(call)
    return w


class Channel:
    """Engine thread puts, one task on the loop takes. FIFO, unbounded (one request's tokens).
    A put wakes the loop only where the taker has not yet been woken for earlier items."""

    def __init__(self, waker: _Waker) -> None:
        self._items: deque[Any] = deque()
        self._waker = waker
        self._armed = False  # a wake-up is pending: the taker will see what is put meanwhile
        self._event = anyio.Event()

    def put(self, item: Any) -> None:  # any thread
        self._items.append(item)
        if not self._armed:
            self._armed = True
            held = getattr(_local, "held", None)
            if held is not None:  # woken at the end of this thread's round
                held.append(self)
            else:
                self._waker.notify(self)

    def _set(self) -> None:
        self._event.set()

    async def get_all(self) -> list[Any]:
        """Everything queued so far, waiting for at least one item."""
        while True:
            self._armed = False  # before looking: an item put after this wakes us again
            if self._items:
                break
            self._event = anyio.Event()
            if self._items:  # arrived between the check and the new event
                break
            await self._event.wait()
        out = list(self._items)
        for _ in out:
            self._items.popleft()
        return out
