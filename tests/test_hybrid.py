"""Hybrid models (recurrent layers beside attention) in the engine, on the tiny parity models:
a prompt chunked over several steps gives what one step gives, a request alone gives what it
gives among 15 others, state slots are taken and given back (finish, cancel, fault), prefix
reuse starts from an exact state snapshot or recomputes, and bad files are refused by name."""
import sys
from pathlib import Path

import anyio
import pytest

from hearthlm import HearthError, Session
from hearthlm.core.errors import ModelLoadError
from hearthlm.runtime import runner as runner_mod

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from models import write  # noqa: E402

HYBRIDS = ["lfm2", "qwen35", "granitehybrid"]


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 250 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    return {v: str(write(d / f"{v}.gguf", v)) for v in HYBRIDS}


async def greedy(s, ids, n=8):
    c = await s.generate(ids, max_tokens=n, temperature=0, ignore_eos=True, top_logprobs=1)
    return c.token_ids, [lp[0][1] for lp in c.top_logprobs]


def close(a, b, tol=1e-3):
    return a[0] == b[0] and all(abs(x - y) < tol for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("variant", HYBRIDS)
async def test_chunked_prompt_equals_one_chunk(models, variant):
    """70 prompt tokens in one step, or in chunks of 16 (the state carried from chunk to chunk)."""
    ids = prompt(3, 70)
    async with Session.open(models[variant], n_ctx=128) as s:
        whole = await greedy(s, ids)
    async with Session.open(models[variant], n_ctx=128, max_batch_tokens=16) as s:
        chunked = await greedy(s, ids)
        assert s.stats()["steps"] >= 5 + 7
    assert close(whole, chunked), (whole, chunked)


@pytest.mark.parametrize("variant", HYBRIDS)
async def test_alone_equals_among_fifteen_others(models, variant):
    target = prompt(7, 23)
    async with Session.open(models[variant], n_ctx=128) as s:
        alone = await greedy(s, target, 12)
    async with Session.open(models[variant], n_ctx=128) as s:
        out = {}

        async def run(i):
            out[i] = await greedy(s, target if i == 0 else prompt(100 + i, 5 + 3 * i), 12)
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(run, i)
        st = s.stats()
        assert st["state_slots_used"] == 0 and st["running_requests"] == 0
    assert close(alone, out[0]), (alone, out[0])


async def test_state_slots_taken_and_given_back(models):
    async with Session.open(models["qwen35"], n_ctx=256, max_seqs=3) as s:
        st = s.stats()
        assert st["state_slots_total"] == 3 and st["state_slots_used"] == 0 and st["state_cache_bytes"] > 0
        seen = []

        async def run(i):
            async for _ in s.stream(prompt(i, 9), max_tokens=20, temperature=0, ignore_eos=True):
                seen.append(s.stats()["state_slots_used"])
        async with anyio.create_task_group() as tg:
            for i in range(7):  # more requests than slots: the rest wait for one
                tg.start_soon(run, i)
        assert max(seen) <= 3 and max(seen) >= 2
        # a cancelled request's slot comes back
        with anyio.move_on_after(0.3):
            await s.generate(prompt(1, 9), max_tokens=200, temperature=0, ignore_eos=True)
        for _ in range(100):
            if s.stats()["running_requests"] == 0:
                break
            await anyio.sleep(0.01)
        assert s.stats()["state_slots_used"] == 0


async def test_a_faulted_step_gives_its_slots_back(models, monkeypatch):
    async with Session.open(models["lfm2"], n_ctx=128) as s:
        want = await greedy(s, prompt(2, 12))
        real, state = runner_mod.execute, {"n": 0}

        def failing(*a, **k):
            state["n"] += 1
            if state["n"] == 1:
                raise RuntimeError("injected")
            return real(*a, **k)
        monkeypatch.setattr(runner_mod, "execute", failing)
        with pytest.raises(HearthError):
            await greedy(s, prompt(2, 12))
        assert s.stats()["state_slots_used"] == 0
        assert close(await greedy(s, prompt(2, 12)), want)


@pytest.mark.parametrize("variant", HYBRIDS)
async def test_prefix_reuse_only_from_a_snapshot(models, variant):
    """A second turn that extends the first prompt starts from the snapshot at the first prompt's
    last block boundary; its output equals a session's that reuses nothing. A prompt sharing
    blocks but no snapshot boundary recomputes."""
    first = prompt(5, 50)                      # its last block boundary: 48
    second = first + prompt(9, 20)
    async with Session.open(models[variant], n_ctx=256) as fresh:
        want = await greedy(fresh, second)
        other = await greedy(fresh, first[:40] + prompt(4, 30))
    async with Session.open(models[variant], n_ctx=256) as s:
        await greedy(s, first)
        assert s.stats()["state_snapshots"] == 1
        got = await greedy(s, second)
        assert s.stats()["prefix_cache_hit_tokens"] == 48
        # shares blocks 0-1 (32 tokens) with `first`, but no snapshot ends there: recomputed
        again = await greedy(s, first[:40] + prompt(4, 30))
        assert s.stats()["prefix_cache_hit_tokens"] == 48
    assert close(want, got), (want, got)
    assert close(other, again), (other, again)


def test_bad_hybrid_files_name_the_problem(tmp_path):
    cases = [
        ("qwen35", {"shape": {"blk.0.ssm_conv1d.weight": (128, 3)}}, "blk.0.ssm_conv1d.weight"),
        ("lfm2", {"drop": "blk.1.shortconv.conv.weight"}, "blk.1.shortconv.conv.weight"),
        ("granitehybrid", {"drop": "blk.0.ssm_a"}, "blk.0.ssm_a"),
        ("lfm2", {"metadata": {"attention.head_count_kv": [0, 2, 0]}}, "one per layer"),
        ("granitehybrid", {"metadata": {"attention.head_count_kv": [0, 2, 0, 4, 0, 2]}}, "different KV head counts"),
        ("qwen35", {"metadata": {"ssm.time_step_rank": 3}}, "ssm.inner_size"),
    ]
    from hearthlm.model_zoo.model import load_model
    for i, (variant, defects, needle) in enumerate(cases):
        p = write(tmp_path / f"bad{i}.gguf", variant, defects=defects)
        with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
            load_model(p)
