"""Wake-ups from the engine thread to the event loop (sdk/_wake.py): a thread that delivers in
rounds holds them until its round ends, then wakes each loop once; and the engine ends every
round of callbacks (a step's, an abort's, a close's) with that flush, so no caller waits on a
wake-up that was held and never sent."""
import asyncio
import threading
import time

import anyio
import pytest
from tiny_gguf import write_tiny

from hearthlm import Session, _wake
from hearthlm import session as session_mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama", n_layer=2))


async def test_a_round_of_puts_wakes_the_loop_once():
    """50 channels put to from a thread in its round: no wake-up until flush, then one call on
    the loop, and every channel has its item. Mutation: Channel.put notifying at once even
    where the thread holds its wake-ups fails it (a call before the flush); so does flush
    forgetting the held channels (the takers time out)."""
    w = _wake.loop_waker()
    calls = []
    real = w._call
    w._call = lambda fn: (calls.append(fn), real(fn))
    try:
        chans = [_wake.Channel(w) for _ in range(50)]
        seen = {}

        def engine_thread():
            _wake.flush()  # the first round's end: from here on this thread holds its wake-ups
            for i, ch in enumerate(chans):
                ch.put(i)
            seen["before"] = len(calls)
            _wake.flush()
            seen["after"] = len(calls)

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        with anyio.fail_after(5):
            got = [await ch.get_all() for ch in chans]
    finally:
        w._call = real
    assert seen == {"before": 0, "after": 1}
    assert got == [[i] for i in range(50)]


async def test_every_round_of_engine_callbacks_is_flushed(tiny, monkeypatch):
    """Requests that finish, one aborted by its caller's timeout and one cut by an aborting
    close: each caller hears of it (nothing waits on a held wake-up), and the last put on the
    engine thread is followed by a flush. Mutation: the engine's flush only after step() (not
    in _serve's finally) fails it: the close's "closed" is held, its caller never wakes."""
    from hearthlm.runtime.engine import Engine
    fast_step = Engine.step

    def slow_step(self):  # the tiny model would finish 300 tokens before the close
        time.sleep(0.002)
        return fast_step(self)

    monkeypatch.setattr(Engine, "step", slow_step)
    log = []
    real_flush, real_put = _wake.flush, _wake.Channel.put
    monkeypatch.setattr(session_mod, "wake_flush", lambda: (log.append("flush"), real_flush()))
    monkeypatch.setattr(_wake.Channel, "put", lambda self, item: (
        log.append("put") if threading.current_thread().name == "hearthlm-engine" else None, real_put(self, item)))
    errors = []
    with anyio.fail_after(30):
        async with Session.open(tiny, n_ctx=512) as s:
            outs = await asyncio.gather(*(s.generate([5 + i, 6, 7], max_tokens=8, temperature=0, ignore_eos=True)
                                          for i in range(4)))
            assert all(len(o.token_ids) == 8 for o in outs)

            async def long(timeout=None):
                try:
                    await s.generate([9, 8, 7], max_tokens=300, temperature=0, ignore_eos=True, timeout=timeout)
                except Exception as e:  # noqa: BLE001 - which one is asserted below
                    errors.append(type(e).__name__)
            async with anyio.create_task_group() as tg:
                tg.start_soon(long, 0.05)
                tg.start_soon(long)
                await anyio.sleep(0.1)
                await s.aclose(abort=True)
    assert sorted(errors) == ["RequestTimeoutError", "SessionClosedError"]
    assert "put" in log and log[-1] == "flush"
