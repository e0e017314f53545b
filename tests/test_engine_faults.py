"""No caller is ever stranded: a fault injected at each stage of the engine's step (planning,
batch assembly, execution, a finish callback) fails the requests it touches with a
HearthError and the engine goes on serving, with the same outputs as before; a fault that
breaks the engine loop itself fails every pending request at once, and every later call,
with EngineFailedError, and health() says why."""
import anyio
import pytest
from tiny_gguf import write_tiny

from hearthlm import EngineFailedError, HearthError, Session
from hearthlm.runtime import runner as runner_mod

PROMPTS = ["one two", "three four five", "six"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("faults") / "tiny.gguf"))


async def run_all(s, prompts, **kw):
    """Each prompt's Completion, or the exception it ended in."""
    out = [None] * len(prompts)

    async def one(i, p):
        try:
            out[i] = await s.generate(p, max_tokens=6, temperature=0, presence_penalty=5.0, **kw)
        except Exception as e:  # noqa: BLE001 - the test looks at the type
            out[i] = e
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):
            tg.start_soon(one, i, p)
    return out


def once(real, exc=RuntimeError("injected")):
    """`real`, raising `exc` on its first call only."""
    state = {"done": False}

    def fn(*a, **k):
        if not state["done"]:
            state["done"] = True
            raise exc
        return real(*a, **k)
    return fn


@pytest.mark.parametrize("stage", ["planning", "assembly", "execution"])
async def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(tiny, monkeypatch, stage):
    async with Session.open(tiny, n_ctx=64) as s:
        clean = [c.token_ids for c in await run_all(s, PROMPTS)]
        e = s.engine
        if stage == "planning":
            monkeypatch.setattr(e.batcher, "plan", once(e.batcher.plan))
        elif stage == "assembly":
            monkeypatch.setattr(e.runner, "inputs", once(e.runner.inputs))
        else:
            monkeypatch.setattr(runner_mod, "execute", once(runner_mod.execute))
        hit = await run_all(s, PROMPTS)
        assert any(isinstance(r, HearthError) for r in hit), hit
        assert all(isinstance(r, HearthError) or r.token_ids == c for r, c in zip(hit, clean)), hit
        assert [c.token_ids for c in await run_all(s, PROMPTS)] == clean
        st = s.stats()
        assert st["kv_blocks_used"] == 0 and st["running_requests"] == 0 and s.health()["ok"]


async def test_a_raising_finish_callback_harms_no_one(tiny, monkeypatch):
    async with Session.open(tiny, n_ctx=64) as s:
        clean = [c.token_ids for c in await run_all(s, PROMPTS)]
        real_submit = s.engine.submit

        def submit(req):  # the first request's on_finish raises after delivering its result
            if req.id == first[0]:
                deliver = req.on_finish

                def bad(reason, err):
                    deliver(reason, err)
                    raise RuntimeError("callback bug")
                req.on_finish = bad
            return real_submit(req)
        first = [None]
        monkeypatch.setattr(s.engine, "submit", lambda req: (first.__setitem__(0, first[0] or req.id), submit(req))[1])
        again = await run_all(s, PROMPTS)
        assert [c.token_ids for c in again] == clean
        assert s.health()["ok"] and s.stats()["kv_blocks_used"] == 0


async def test_a_broken_engine_loop_fails_everything_at_once(tiny, monkeypatch):
    async with Session.open(tiny, n_ctx=64) as s:
        e = s.engine
        lengths = [8, 30, 30]  # the first to finish meets a broken KV release, outside any step's guard
        results = [None] * len(lengths)

        async def one(i):
            try:
                results[i] = await s.generate(PROMPTS[i], max_tokens=lengths[i], temperature=0, ignore_eos=True)
            except Exception as x:  # noqa: BLE001 - the test looks at the type
                results[i] = x

        def broken_release(req):
            raise RuntimeError("allocator corrupted")
        monkeypatch.setattr(e.batcher, "release", broken_release)
        with anyio.fail_after(30):  # nobody stranded
            async with anyio.create_task_group() as tg:
                for i in range(len(lengths)):
                    tg.start_soon(one, i)
        assert len(results[0].token_ids) == 8  # it had finished: its caller still got it
        # the step that met it fails its batch (a HearthError each), whose next release breaks the
        # loop: whoever is left gets EngineFailedError
        assert all(isinstance(r, HearthError) for r in results[1:]), results
        assert isinstance(results[-1], EngineFailedError), results
        h = s.health()
        assert not h["ok"] and "allocator corrupted" in h["error"]
        with pytest.raises(EngineFailedError, match="allocator corrupted"):
            await s.generate("hi", max_tokens=1)
        assert not s.stats()["healthy"]
