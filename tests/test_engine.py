"""The continuous-batching engine on a tiny synthetic llama: concurrency, cancellation,
queue bound, preemption, prefix reuse, determinism; under asyncio and trio."""
import time

import anyio
import numpy as np
import pytest
from tiny_gguf import write_tiny

from hearthlm import ContextLengthError, QueueFull, Session, SessionClosedError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama", n_layer=2))


def prompt(i: int, n: int = 12) -> list[int]:
    return [3 + (i * 7 + k * 13) % 250 for k in range(n)]


async def alone(path, p, **kw) -> list[int]:
    async with Session.open(path, n_ctx=256) as s:
        return (await s.generate(p, **{"temperature": 0, **kw})).token_ids


async def wait_idle(s: Session) -> dict:
    for _ in range(200):
        st = s.stats()
        if st["running_requests"] == 0 and st["queue_depth"] == 0:
            return st
        await anyio.sleep(0.01)
    return s.stats()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_100_concurrent_with_10_cancelled(tiny, backend):
    """Run by anyio.run on each event loop (pytest-asyncio would run an async test on asyncio
    whatever it is parametrized by). Mutation: the body awaited directly by pytest-asyncio, as
    it was: the trio case runs on asyncio and the sniffio check fails."""
    anyio.run(_100_concurrent_with_10_cancelled, tiny, backend, backend=backend)


async def _100_concurrent_with_10_cancelled(tiny, backend):
    import sniffio
    assert sniffio.current_async_library() == backend
    singles = {i: await alone(tiny, prompt(i), max_tokens=6 + i % 5, ignore_eos=True) for i in range(0, 100, 7) if i % 10 != 3}
    results: dict[int, list[int]] = {}
    async with Session.open(tiny, n_ctx=256, max_seqs=64, max_batch_tokens=256) as s:
        async def run(i: int) -> None:
            if i % 10 == 3:  # cancelled midway through its stream
                n = 0
                async for c in s.stream(prompt(i), max_tokens=200, temperature=0, ignore_eos=True):
                    n += len(c.token_ids)
                    if n >= 3:
                        break
                return
            c = await s.generate(prompt(i), max_tokens=6 + i % 5, temperature=0, ignore_eos=True)
            results[i] = c.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(run, i)
        st = await wait_idle(s)
        assert st["kv_blocks_used"] == 0
    assert len(results) == 90
    for i, ids in results.items():
        assert len(ids) == 6 + i % 5
    for i, ids in singles.items():  # greedy tokens equal the single-run tokens
        assert results[i] == ids, f"request {i} differs in a batch"


async def test_cancel_frees_blocks_within_a_step(tiny):
    async with Session.open(tiny, n_ctx=256) as s:
        with anyio.move_on_after(0.2):
            await s.generate(prompt(1), max_tokens=240, temperature=0, ignore_eos=True)
        st = await wait_idle(s)
        assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0
        assert len((await s.generate(prompt(2), max_tokens=3, temperature=0, ignore_eos=True)).token_ids) == 3


async def test_stats_never_show_no_request_while_its_blocks_are_held(tiny):
    """A request that finishes while stats() runs (here: aborted and finished by the engine
    thread just after the memory was read) is seen either as running or with its blocks free.
    Mutation: Engine.stats reading the memory before the request lists, as it did, fails it
    with 0 running and the request's block held. test_cancel_frees_blocks_within_a_step once
    failed so in a clean clone's run (0 running, 16 blocks): its wait for an idle engine
    returned in that window."""
    async with Session.open(tiny, n_ctx=256) as s:
        eng = s.engine
        chunks = s.stream(prompt(1), max_tokens=240, temperature=0, ignore_eos=True)
        await chunks.__anext__()  # running, its blocks held
        real = eng.memory.stats

        def read_then_finish():
            st = real()
            for r in list(eng.running):
                eng.abort(r.id)
            t = time.monotonic()
            while eng.running and time.monotonic() - t < 10:  # the engine thread finishes it
                time.sleep(0.001)
            return st
        eng.memory.stats = read_then_finish
        try:
            st = s.stats()
        finally:
            del eng.memory.stats
        assert not eng.running and s.stats()["kv_blocks_used"] == 0  # it did finish in between
        assert st["running_requests"] == 1 or st["kv_blocks_used"] == 0, st
        await chunks.aclose()


def test_requests_join_their_next_list_before_leaving_the_last():
    """Batcher.plan moves an admitted request into `running` before it leaves `waiting`, and a
    preempted one back into `waiting` before it leaves `running`, so that Engine.stats, reading
    the lists from another thread, never misses a request that holds blocks. Mutations: popleft
    before the append, or the preempted removed before they are queued again, each fail it."""
    from collections import deque

    from hearthlm.backends.reference import ReferenceBackend
    from hearthlm.runtime.batcher import Batcher
    from hearthlm.runtime.kv_cache import KVCache
    from hearthlm.runtime.request import Kind, Request
    from hearthlm.runtime.sampling import SamplingParams
    from hearthlm.runtime.seq_memory import SequenceMemory

    class Running(list):
        def remove(self, r):
            assert r in waiting, "left running before it was queued again"
            super().remove(r)

    class Waiting(deque):
        def popleft(self):
            assert self[0] in running, "left the queue before it was running"
            return super().popleft()

    reqs = [Request(prompt=list(range(1, 33)), params=SamplingParams(), max_tokens=8, on_token=lambda *a: None,
                    on_finish=lambda *a: None, kind=Kind.GENERATE) for _ in range(2)]
    for i, r in enumerate(reqs):
        r.arrival = float(i)
    b = Batcher(SequenceMemory(KVCache([(1, 4)], 6, 16, [ReferenceBackend()])), max_batch_tokens=512, max_seqs=8)
    running, waiting = Running(), Waiting(reqs)
    plan = b.plan(running, waiting)  # both admitted: 4 of the 5 blocks
    assert list(running) == reqs and not waiting and [s.n_tokens for s in plan.seqs] == [32, 32]
    for r in reqs:  # their prompts computed; each now needs a third block, and one is left
        r.n_computed = 32
        r.tokens.append(7)
    plan = b.plan(running, waiting)
    assert plan.preempted == [reqs[1]] and list(running) == [reqs[0]] and list(waiting) == [reqs[1]]


async def test_blocks_are_freed_before_a_request_leaves_the_lists(tiny):
    """stats() runs on the caller's thread while the engine's finishes a request: its blocks are
    freed while it is still listed, so "no running requests" never comes with their blocks still
    held (test_cancel_frees_blocks_within_a_step saw 16 blocks once, on a loaded host). Mutation:
    removing the request from the running list before releasing its memory fails it."""
    async with Session.open(tiny, n_ctx=256) as s:
        eng, listed = s.engine, []
        release = eng.batcher.release

        def spy(req):
            listed.append(req in eng.running or req in eng.waiting)
            release(req)
        eng.batcher.release = spy
        with anyio.move_on_after(0.2):
            await s.generate(prompt(1), max_tokens=240, temperature=0, ignore_eos=True)
        await s.generate(prompt(2), max_tokens=3, temperature=0, ignore_eos=True)
        await wait_idle(s)
    assert len(listed) >= 2 and all(listed), listed


async def test_queue_bound(tiny):
    async with Session.open(tiny, n_ctx=256, max_queued_requests=2, max_seqs=1) as s:
        errors, done = [], []

        async def run(i):
            try:
                done.append(await s.generate(prompt(i), max_tokens=30, temperature=0, ignore_eos=True))
            except QueueFull as e:
                errors.append(e)
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(run, i)
        assert errors and all("queued" in str(e) for e in errors)
        assert len(done) + len(errors) == 6 and len(done) >= 2


async def test_preemption_with_tiny_kv_pool(tiny):
    """A pool of 12 blocks of 16 tokens for 6 requests of 60+ tokens: some get preempted and
    recomputed, and every output equals the one computed with plenty of room."""
    want = {}
    async with Session.open(tiny, n_ctx=128) as s:
        for i in range(6):
            want[i] = (await s.generate(prompt(i, 30), max_tokens=40, temperature=0, ignore_eos=True)).token_ids
    got = {}
    async with Session.open(tiny, n_ctx=128, kv_cache_tokens=12 * 16) as s:
        async def run(i):
            got[i] = (await s.generate(prompt(i, 30), max_tokens=40, temperature=0, ignore_eos=True)).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(run, i)
        st = s.stats()
        assert st["preemptions"] > 0
        assert st["kv_blocks_used"] == 0
    assert got == want


async def test_request_that_can_never_fit_fails_at_once(tiny):
    async with Session.open(tiny, n_ctx=64) as s:
        with pytest.raises(ContextLengthError, match="64"):
            await s.generate(prompt(0, 40), max_tokens=30)
        with pytest.raises(ContextLengthError):
            await s.generate(prompt(0, 70))


async def test_prefix_reuse_computes_shared_prefix_once(tiny):
    system = prompt(5, 64)  # four full blocks
    async with Session.open(tiny, n_ctx=256) as s:
        first = await s.generate(system + prompt(1, 5), max_tokens=4, temperature=0, ignore_eos=True)
        computed = s.stats()["tokens_computed"]
        second = await s.generate(system + prompt(2, 5), max_tokens=4, temperature=0, ignore_eos=True)
        st = s.stats()
        assert st["prefix_cache_hit_tokens"] == 64
        # the second request computed only its own 5 tokens (+3 decode steps), not the prefix
        assert st["tokens_computed"] - computed == 5 + 3
        again = await s.generate(system + prompt(1, 5), max_tokens=4, temperature=0, ignore_eos=True)
        assert again.token_ids == first.token_ids
    assert second.token_ids == await alone(tiny, system + prompt(2, 5), max_tokens=4, ignore_eos=True)


async def test_seeded_sampling_same_alone_or_batched(tiny):
    kw = dict(max_tokens=12, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=123, ignore_eos=True)
    solo = await alone(tiny, prompt(7), **{k: v for k, v in kw.items()})
    async with Session.open(tiny, n_ctx=256) as s:
        res = {}

        async def run(i, seed):
            res[i] = (await s.generate(prompt(7 if i == 0 else i), **dict(kw, seed=seed))).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(run, i, 123 if i == 0 else i)
    assert res[0] == solo


async def test_close_aborts_or_finishes(tiny, monkeypatch):
    # steps slowed to 2 ms: the tiny model would otherwise finish 200 tokens before the close
    from hearthlm.runtime.engine import Engine
    fast_step = Engine.step

    def slow_step(self):
        time.sleep(0.002)
        return fast_step(self)

    monkeypatch.setattr(Engine, "step", slow_step)
    errors = []
    async with Session.open(tiny, n_ctx=256) as s:
        async def long():
            try:
                await s.generate(prompt(1), max_tokens=200, temperature=0, ignore_eos=True)
            except SessionClosedError as e:
                errors.append(e)
        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await anyio.sleep(0.05)
            await s.aclose(abort=True)
        with pytest.raises(SessionClosedError):
            await s.generate(prompt(1), max_tokens=2)
    assert len(errors) == 1 and "closed" in str(errors[0])
    out = {}
    async with Session.open(tiny, n_ctx=256, abort_on_close=False) as s:
        async def fin():
            out["c"] = await s.generate(prompt(1), max_tokens=50, temperature=0, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fin)
            await anyio.sleep(0.05)
            await s.aclose(abort=False)
    assert len(out["c"].token_ids) == 50 and out["c"].finish_reason == "length"


def test_sync_session(tiny):
    from hearthlm import SyncSession
    with SyncSession(tiny, n_ctx=256) as s:
        c = s.generate(prompt(1), max_tokens=5, temperature=0, ignore_eos=True)
        chunks = list(s.stream(prompt(1), max_tokens=5, temperature=0, ignore_eos=True))
        assert [t for ch in chunks for t in ch.token_ids] == c.token_ids
        for _ch in s.stream(prompt(1), max_tokens=100, temperature=0, ignore_eos=True):
            break  # leaving early aborts the request
        # three requests, one after another, one token per step each: 5 + 5 + at least 1
        st = s.stats()
        assert st["tokens_generated"] >= 11 and st["steps"] >= 11


@pytest.mark.parametrize("args", ["TINY, bogus=1", "'/nonexistent/model.gguf'", "MALFORMED"])
def test_sync_session_failing_to_open_lets_the_script_exit(tiny, tmp_path, args):
    """A script whose SyncSession(...) raises (an option misspelt, a missing or malformed file) prints
    the error and exits. Mutation: `Session.open(...)` back outside the `try` that stops the portal
    (as it was) hangs the bad-option case until the timeout."""
    import subprocess
    import sys
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)
    script = (f"from hearthlm import SyncSession\nTINY, MALFORMED = {tiny!r}, {str(bad)!r}\n"
              f"SyncSession({args})\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert ("TypeError" if "bogus" in args else "Error") in r.stderr.splitlines()[-1]


@pytest.mark.parametrize("main_thread_engine_first", [False, True])
async def test_blas_limit_held_while_any_session_runs(tiny, main_thread_engine_first):
    """Also after an engine started and closed in the main thread (as the graph-cache tests
    do): threadpoolctl then made the main thread OpenBLAS's only setter, and a session's
    engine, started in a worker thread, silently set nothing."""
    from threadpoolctl import threadpool_info

    from hearthlm.runtime import engine as engine_mod
    blas = lambda: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]  # noqa: E731
    if main_thread_engine_first:
        engine_mod._blas_single_threaded(+1)
        engine_mod._blas_single_threaded(-1)
    before = blas()
    async with Session.open(tiny, n_ctx=64) as a:
        async with Session.open(tiny, n_ctx=64):
            assert all(n == 1 for n in blas())
        assert all(n == 1 for n in blas())  # the other session still runs
        await a.generate(prompt(1, 4), max_tokens=2)
    assert blas() == before


async def test_steps_stay_within_the_token_budget(tiny, monkeypatch):
    """Six 100-token prompts under max_batch_tokens=64: every planned step holds at most 64
    tokens, some hold exactly 64 (the budget is filled, not just respected by idling), and the
    outputs equal each request's run alone. Mutation: `budget -= take` in runtime/batcher.py
    made a no-op plans steps of 600 tokens."""
    from hearthlm.runtime.batcher import Batcher
    sizes: list[int] = []
    plan = Batcher.plan

    def recording(self, running, waiting):
        p = plan(self, running, waiting)
        sizes.append(p.n_tokens)
        return p

    monkeypatch.setattr(Batcher, "plan", recording)
    got = {}
    async with Session.open(tiny, n_ctx=256, max_batch_tokens=64) as s:
        async def run(i):
            got[i] = (await s.generate(prompt(i, 100), max_tokens=5, temperature=0, ignore_eos=True)).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(run, i)
        assert s.stats()["tokens_computed"] == sum(sizes)
    assert max(sizes) <= 64, sizes
    assert sizes.count(64) >= 6 * 100 // 64 - 1, sizes  # the prompts are chunked to fill the budget
    monkeypatch.setattr(Batcher, "plan", plan)
    for i in range(6):
        assert got[i] == await alone(tiny, prompt(i, 100), max_tokens=5, ignore_eos=True), i


async def test_prefix_cache_keys_blocks_by_everything_before_them(tiny):
    """A block's K/V depend on its position and all tokens before it, so the prefix cache keys a
    block by its tokens chained to its parent's hash. Here prompt B's first block holds the same
    tokens as prompt A's second block (and B's second the same as A's second): none of B's
    blocks may be taken from A's, and B's log-probs equal a cold run's (the tiny model's greedy
    tokens are one token repeated: its runner-up log-probs show the K/V). Mutation: the parent's
    hash dropped from runtime/kv_cache.py's block_hash makes B's blocks hit A's second block (K/V
    rotated for positions 16-31 read at 0-15): 32 hit tokens, runner-ups ~3 nats off."""
    x, y = prompt(11, 16), prompt(12, 16)
    a, b = x + y + prompt(13, 5), y + y + prompt(14, 5)
    kw = dict(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=3)

    def same(c1, c2) -> bool:
        return all([t for t, _ in s1] == [t for t, _ in s2] and np.allclose([v for _, v in s1], [v for _, v in s2], atol=1e-3)
                   for s1, s2 in zip(c1.top_logprobs, c2.top_logprobs, strict=True))
    async with Session.open(tiny, n_ctx=256) as s:
        cold = await s.generate(b, **kw)
    async with Session.open(tiny, n_ctx=256) as s:
        await s.generate(a, max_tokens=1, temperature=0)
        got = await s.generate(b, **kw)
        assert s.stats()["prefix_cache_hit_tokens"] == 0
        assert same(got, cold)
        again = await s.generate(b, **kw)  # its own two blocks are reused: the cache does work here
        assert s.stats()["prefix_cache_hit_tokens"] == 32
        assert same(again, cold)


async def test_sampled_tokens_the_same_from_picks_or_logits(tiny, monkeypatch):
    """Concurrent seeded generations, sampled hot (top_k 5 and 40) and greedy in one batch: the
    tokens are the same whether the steps take each row's top_k where the logits are (picks) or
    return the logits; and the picks were taken. Mutations seen to fail: the runner's padding
    of ks dropped past the real rows' count, emit_by_rule slicing the picks at k - 1."""
    from hearthlm.runtime.output import OutputProcessor
    from hearthlm.runtime.runner import ModelRunner
    # hot: the tiny model's logits are peaked (its top logit ~13 above the next)
    kws = [dict(temperature=9.0, top_k=5, seed=3), dict(temperature=6.0, top_k=40, top_p=0.9, seed=4),
           dict(temperature=0), dict(temperature=12.0, top_k=40, min_p=0.0, seed=5)]

    async def batch() -> list[list[int]]:
        res = {}
        async with Session.open(tiny, n_ctx=256) as s:
            async def run(i):
                res[i] = (await s.generate(prompt(i), max_tokens=10, ignore_eos=True, **kws[i % 4])).token_ids
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(run, i)
        return [res[i] for i in range(8)]

    taken = []
    pick = ModelRunner._pick
    monkeypatch.setattr(ModelRunner, "_pick", staticmethod(lambda b, lg, ks: taken.append(ks) or pick(b, lg, ks)))
    got = await batch()
    assert any(len(ks) > 1 and (ks > 1).any() for ks in taken)
    monkeypatch.setattr(OutputProcessor, "picks", lambda self, plan: None)
    assert got == await batch()
