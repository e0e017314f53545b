"""Speculative decoding on hybrid models (recurrent layers beside attention): the recurrent ops'
per-position state snapshots (snap_slot) equal the states of the prefixes run alone; n-gram and
draft-model speculation on lfm2, qwen35 and granitehybrid give plain decoding's greedy tokens and
log-probs, with drafts kept and rejected (the state rolled back to the last kept token), alone
and batched beside plain requests; sampled output is scored by the plain model's own
distribution at every position; the rollback slots come back."""
from __future__ import annotations

import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from hearthlm import Session
from hearthlm.backends import reference
from hearthlm.backends.cpu import delta_net, ssm
from hearthlm.backends.reference import ReferenceBackend
from hearthlm.runtime.kv_cache import KVCache
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.runtime.seq_memory import SequenceMemory, StateCache
from hearthlm.runtime.speculative import NgramDrafter

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from gather import record_drafts
from models import write  # noqa: E402

HYBRIDS = ["lfm2", "qwen35", "granitehybrid"]
GREEDY = dict(temperature=0, ignore_eos=True, top_logprobs=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybspec")
    return {v: str(write(d / f"{v}.gguf", v)) for v in [*HYBRIDS, "llama"]}


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 250 + 3 for i in range(n)]


# ---- the kernels: the state after each token, written where snap_slot says -------------------

def _ops(rng):
    """Per op: (reference fn, cpu fn, state shape, per-token inputs, kwargs); one sequence row."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    n = 5
    conv = (lambda st, x, snap, off, sl, y=None: reference.ssm_conv(st, *x, off, sl, snap),
            lambda st, x, snap, off, sl, y: (ssm.ssm_conv(st, x[0], np.ascontiguousarray(x[1].T), off, sl, snap, y), y)[1],
            (3, 64), [f(n, 64)], [f(64, 4)], (n, 64))
    scan = (lambda st, x, snap, off, sl, y=None: reference.ssm_scan(st, x[0], x[1], x[4], x[2], x[3], off, sl, snap),
            lambda st, x, snap, off, sl, y: (ssm.ssm_scan(st, x[0], x[1], x[4], x[2], x[3], off, sl, snap, y), y)[1],
            (4, 8, 16), [f(n, 4, 8), f(n, 4), f(n, 2, 16), f(n, 2, 16)], [-np.abs(f(4))], (n, 4, 8))
    delta = (lambda st, x, snap, off, sl, y=None: reference.gated_delta_net(st, *[a * 0.3 for a in x[:3]], -np.abs(x[3]),
                                                                              np.abs(x[4]) * 0.2, off, sl, 0.2, snap=snap),
             lambda st, x, snap, off, sl, y: (delta_net.gated_delta_net_1(
                 st, *[a * 0.3 for a in x[:3]], -np.abs(x[3]), np.abs(x[4]) * 0.2, off, sl, snap, 0.2, y), y)[1],
             (4, 16, 16), [f(n, 2, 16), f(n, 2, 16), f(n, 4, 16), f(n, 4), f(n, 4)], [], (n, 4, 16))
    return {"ssm_conv": conv, "ssm_scan": scan, "gated_delta_net": delta}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("op", ["ssm_conv", "ssm_scan", "gated_delta_net"])
def test_snapshots_are_the_states_of_the_prefixes(op, backend):
    """Five tokens of one row from slot 1, the state after tokens 0, 2 and 3 snapshotted to slots
    4, 2, 5: each snapshot equals the state after running only that prefix, bit for bit; the row's
    outputs and final state equal a run without snapshots; other slots are untouched.
    Mutation: the cpu delta net snapshotting before its token's update fails it (so does the conv
    writing xx's rows from t - t0 instead of t - t0 + 1)."""
    rng = np.random.default_rng(3)
    ref_fn, cpu_fn, st_shape, toks, consts, y_shape = _ops(rng)[op]
    fn = ref_fn if backend == "reference" else cpu_fn
    call = lambda st, n, snap: fn(st, [t[:n] for t in toks] + consts, snap, np.array([0, n], np.int32),  # noqa: E731
                                  np.array([1], np.int32), np.zeros((n, *y_shape[1:]), np.float32))
    init = (rng.standard_normal((6, *st_shape)) * 0.3).astype(np.float32)
    snap = np.array([4, -1, 2, 5, -1], np.int32)
    st = init.copy()
    y = call(st, 5, snap)
    plain = init.copy()
    y_plain = call(plain, 5, np.zeros(0, np.int32) if backend == "cpu" else None)
    assert np.array_equal(st[1], plain[1]) and np.array_equal(y, y_plain)
    for t, slot in enumerate(snap):
        if slot >= 0:
            alone = init.copy()
            call(alone, t + 1, np.zeros(0, np.int32) if backend == "cpu" else None)
            assert np.array_equal(st[slot], alone[1]), (op, backend, t)
    assert np.array_equal(st[[0, 3]], init[[0, 3]])


# ---- the rollback interface (runtime.seq_memory) ---------------------------------------------

def test_reserve_and_rollback():
    """reserve_rollback gives a slot per position while the pool lasts (a prefix of them);
    rollback(req, n) makes the slot holding the state after n tokens the request's own (its old
    slot back to the pool), gives back the rest, and with no snapshot at n starts over from 0
    with a zeroed state; release gives rollback slots back too.
    Mutation: rollback not swapping the slot in (the state left after the rejected drafts) fails it."""
    be = ReferenceBackend()
    state = StateCache([{"s": (2,)}], 2 + 1 + 3, [be])  # scratch, 2 sequences, 3 rollback slots
    mem = SequenceMemory(KVCache([(1, 4)], 8, 4, [be]), state, n_rollback=3)
    req = Request(prompt=[1, 2, 3], params=SamplingParams(), max_tokens=8, kind=Kind.GENERATE, on_token=lambda *a: None,
                  on_finish=lambda *a: None)
    assert mem.admit(req) and mem.grow(req, 8)
    req.n_computed = 3
    assert mem.reserve_rollback(req, range(3, 7)) == 3  # 4 asked, the pool holds 3
    assert sorted(req.state_snaps) == [3, 4, 5]
    for n, slot in req.state_snaps.items():  # as the kernels would leave them
        state.arrays[("s", 0)][slot] = n
    own = req.state_slot
    state.arrays[("s", 0)][own] = 6
    req.n_computed = 6  # the step ran 3 more tokens; the target keeps 1 of them: 4 in all
    assert mem.rollback(req, 4) == 4 and req.n_computed == 4
    assert state.arrays[("s", 0)][req.state_slot].tolist() == [4, 4] and req.state_slot != own
    assert req.state_snaps == {} and mem.stats()["state_rollback_slots_used"] == 0
    assert mem.reserve_rollback(req, range(4, 5)) == 1
    req.n_computed = 5
    assert mem.rollback(req, 5) == 5 and mem.stats()["state_rollback_slots_used"] == 0  # all kept: no change
    req.n_computed = 6
    assert mem.rollback(req, 5) == 0  # no snapshot there: from the start
    assert not state.arrays[("s", 0)][req.state_slot].any()
    assert mem.reserve_rollback(req, range(0, 2)) == 2
    mem.release(req)
    assert mem.stats()["state_rollback_slots_used"] == 0 and mem.stats()["state_slots_used"] == 0
    plain = SequenceMemory(KVCache([(1, 4)], 8, 4, [be]))  # no recurrent state: every position "reserved"
    assert plain.reserve_rollback(req, range(0, 10)) == 10 and req.state_snaps == {}


# ---- the engine: greedy identity with drafts kept and rejected ---------------------------------

class Oracle:
    """Drafts from known continuations (prompt + plain greedy output), one draft token made wrong
    at a spot that moves with the position: drafts are kept whole, in part and not at all."""

    def __init__(self, refs: list[list[int]]) -> None:
        self.refs = refs

    def propose(self, drafter, tokens: list[int], limit: int) -> list[int]:
        ref = next((r for r in self.refs if r[:len(tokens)] == tokens), None)
        limit = min(drafter.k, limit)
        if ref is None or limit <= 0:
            return []
        d = list(ref[len(tokens):len(tokens) + limit])
        j = len(tokens) % 4  # 3: all kept
        if j < len(d) and j < 3:
            d[j] = 3 + (d[j] + 1) % 250
        return d


def _oracle(monkeypatch, refs):
    o = Oracle(refs)
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, tokens, limit: o.propose(self, tokens, limit))


def _lps(c):
    return [t[0][1] for t in c.top_logprobs]


@pytest.mark.parametrize("variant,backend", [(v, "cpu") for v in HYBRIDS] + [("qwen35", "reference")])
async def test_ngram_greedy_identical_alone_and_batched(models, variant, backend, monkeypatch):
    """Two speculating requests beside two plain ones, and one alone: tokens equal plain decoding's,
    log-probs within 1e-3 alone and 5e-3 batched (a batch's rows, a prompt chunk's among them, take
    other matmul paths than one decode row: lfm2's random logits move by up to ~1e-3 with them,
    speculating or not); drafts kept and rejected; no rollback slot or state slot held after.
    Mutation: rollback() not going back to the snapshot (the state left after the rejected
    drafts) fails it; so does the runner filling snap_slot one token late."""
    prompts = [prompt(i, 20 + 7 * i) for i in range(4)]
    async with Session.open(models[variant], n_ctx=256, backend=backend) as s:
        ref = [await s.generate(p, max_tokens=24, **GREEDY) for p in prompts]
        _oracle(monkeypatch, [p + r.token_ids for p, r in zip(prompts, ref)])
        before = s.stats()
        alone = await s.generate(prompts[0], max_tokens=24, speculative="ngram", **GREEDY)
        out = [None] * 4

        async def one(i):
            out[i] = await s.generate(prompts[i], max_tokens=24, speculative="ngram" if i % 2 == 0 else None, **GREEDY)
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        st = s.stats()
    for got, want in [(alone, ref[0]), *zip(out, ref)]:
        assert got.token_ids == want.token_ids
        assert _lps(got) == pytest.approx(_lps(want), abs=5e-3)
    assert _lps(alone) == pytest.approx(_lps(ref[0]), abs=1e-3)
    drafted = st["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    kept = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < kept < drafted, (drafted, kept)
    assert st["state_rollback_slots_used"] == 0 and st["state_slots_used"] == 0


async def test_rollback_slots_bound_the_drafts(models, monkeypatch):
    """SessionOptions.rollback_slots: 2 slots, drafts of at most 2 tokens a step (the same
    output); 0, none drafted on a hybrid.
    Mutation: the engine not cutting a draft to the slots reserve_rollback gave fails it."""
    p = prompt(6, 25)
    async with Session.open(models["lfm2"], n_ctx=256) as s:
        ref = await s.generate(p, max_tokens=30, **GREEDY)
    _oracle(monkeypatch, [p + ref.token_ids])
    for n in (2, 0):
        async with Session.open(models["lfm2"], n_ctx=256, rollback_slots=n) as s:
            got = await s.generate(p, max_tokens=30, speculative="ngram", **GREEDY)
            st = s.stats()
        assert got.token_ids == ref.token_ids
        drafted = st["spec_drafted_tokens"]
        assert (drafted == 0) if n == 0 else (0 < drafted <= 2 * (st["steps"] - 1)), (n, drafted, st["steps"])


async def test_rollback_slots_default_to_few_without_a_drafter(models):
    """Each rollback slot is a whole recurrent state allocated at open: 4 by default (requests
    that ask speculative= themselves), 16 with a draft model, the option's value when given.
    Mutation: the default back to 16 for every session fails it."""
    for kw, n in (({}, 4), ({"draft_model": models["lfm2"]}, 16), ({"rollback_slots": 7}, 7)):
        async with Session.open(models["lfm2"], n_ctx=256, **kw) as s:
            assert s.engine.memory.n_rollback == n, (kw, s.engine.memory.n_rollback)


async def test_preempted_speculating_requests(models, monkeypatch):
    """Five speculating requests in a KV cache too small for all: some are preempted mid-draft
    (their rollback slots given back) and recomputed; every output equals plain decoding's.
    Mutation: rollback() not swapping the snapshot in fails it (release() not freeing rollback
    slots is the unit test's)."""
    prompts = [prompt(i, 30) for i in range(5)]
    async with Session.open(models["qwen35"], n_ctx=128) as s:
        ref = [await s.generate(p, max_tokens=40, **GREEDY) for p in prompts]
    _oracle(monkeypatch, [p + r.token_ids for p, r in zip(prompts, ref)])
    async with Session.open(models["qwen35"], n_ctx=128, kv_cache_tokens=160) as s:
        out = [None] * 5

        async def one(i):
            out[i] = await s.generate(prompts[i], max_tokens=40, speculative="ngram", **GREEDY)
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
        st = s.stats()
    assert st["preemptions"] > 0
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert st["state_rollback_slots_used"] == 0 and st["state_slots_used"] == 0


async def test_sampled_tokens_are_scored_by_the_plain_model(models, monkeypatch):
    """Sampled speculative output (drafts from the greedy run, kept and rejected): at every
    generated position the top log-probs reported equal the plain model's for the same prefix
    (the prompt log-probs of prompt + output), so each token was drawn by rejection sampling
    (tests/test_speculative.py: the target's distribution) from the right state.
    Mutation: rollback() keeping the state after the rejected drafts fails it."""
    p = prompt(5, 24)
    async with Session.open(models["qwen35"], n_ctx=256) as s:
        greedy = await s.generate(p, max_tokens=30, **GREEDY)
        _oracle(monkeypatch, [p + greedy.token_ids])
        before = s.stats()
        got = await s.generate(p, max_tokens=30, temperature=0.4, seed=11, ignore_eos=True, top_logprobs=3,
                               speculative="ngram")
        st = s.stats()
        scored = await s.generate(p + got.token_ids, max_tokens=0, prompt_logprobs=3)
    assert 0 < st["spec_accepted_tokens"] - before["spec_accepted_tokens"] < st["spec_drafted_tokens"] - before[
        "spec_drafted_tokens"]
    assert got.token_ids != greedy.token_ids  # sampled, not the greedy run
    plain = scored.prompt_logprobs[len(p):]
    assert len(plain) == len(got.top_logprobs)
    for i, (a, b) in enumerate(zip(got.top_logprobs, plain)):
        want = {t: lp for t, lp in (b[2] or [])}
        for t, lp in a:
            assert t in want and abs(lp - want[t]) < 5e-3, (i, a, b)  # decode rows against a prompt's


async def test_rejection_sampling_on_a_hybrid_keeps_the_distribution(models, monkeypatch):
    """tests/test_speculative.py's rejection test through a hybrid's engine: top-4 sampling at
    temperature 1, the second token drafted (the greedy one, after the greedy first): 1,600 draws
    of (first, second) come out as the model's own joint distribution, computed exactly from the
    prompt log-probs of each prefix (5 sigma per outcome).
    Mutation: sampling.verify keeping every draft token fails it, and so does its resampling
    without taking the rejected draft out."""
    p = prompt(8, 20)
    kw = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, ignore_eos=True)
    async with Session.open(models["qwen35"], n_ctx=256) as s:
        g = (await s.generate(p, max_tokens=2, **GREEDY)).token_ids

        async def top4(prefix):  # the top-k sampling distribution after `prefix`
            lps = (await s.generate(prefix + [3], max_tokens=0, prompt_logprobs=4)).prompt_logprobs[len(prefix)][2]
            w = {t: np.exp(lp) for t, lp in lps}
            return {t: v / sum(w.values()) for t, v in w.items()}
        first = await top4(p)
        want = {(a, b): pa * pb for a, pa in first.items() for b, pb in (await top4(p + [a])).items()}
        assert g[0] in first
        monkeypatch.setattr(NgramDrafter, "propose", lambda self, tokens, limit: [g[1]] if tokens == p + g[:1] else [])
        got: dict = {}

        async def draw(j):
            for c in await s.generate_n(p, n=16, seed=16 * j, max_tokens=3, speculative="ngram", **kw):
                got[tuple(c.token_ids[:2])] = got.get(tuple(c.token_ids[:2]), 0) + 1
        for half in (0, 50):  # 800 requests at a time: under the engine's queue bound
            async with anyio.create_task_group() as tg:
                for j in range(half, half + 50):
                    tg.start_soon(draw, j)
        st = s.stats()
    n = sum(got.values())
    assert n == 1600 and set(got) <= set(want), set(got) - set(want)
    assert 0 < st["spec_accepted_tokens"] < st["spec_drafted_tokens"]
    for k, q in want.items():
        assert abs(got.get(k, 0) / n - q) < 5 * np.sqrt(q * (1 - q) / n) + 1e-9, (k, got.get(k, 0) / n, q)


# ---- the draft model: hybrid targets, hybrid drafts ---------------------------------------------

@pytest.mark.parametrize("target,draft,penalty", [("lfm2", "lfm2", 0.0), ("qwen35", "qwen35", 1.5),
                                                   ("granitehybrid", "granitehybrid", 1.5), ("qwen35", "llama", 0.0),
                                                   ("llama", "lfm2", 0.0)])
async def test_draft_model_greedy_identical(models, target, draft, penalty):
    """A hybrid target with a draft model: itself (every draft kept); itself under a repetition
    penalty the draft does not apply (drafts kept in part: the draft model's own state rolled
    back too); a KV-only model of other weights; and a KV-only target with a hybrid draft. Plain decoding's tokens and log-probs, also
    batched beside a plain request; the draft's KV blocks and both rollback pools come back.
    (The draft model's own rollback is checked by the next test: here it changes acceptance only.)"""
    ps = [prompt(2, 30), prompt(9, 17)]
    kw = dict(max_tokens=24, frequency_penalty=penalty, **GREEDY)
    async with Session.open(models[target], n_ctx=256, draft_model=models[draft], draft_p_min=0.0) as s:
        ref = [await s.generate(p, speculative="off", **kw) for p in ps]
        got = await s.generate(ps[0], **kw)
        out = [None, None]

        async def one(i):
            out[i] = await s.generate(ps[i], speculative=None if i == 0 else "off", **kw)
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
        st = s.stats()
        draft_mem = s.engine.draft.memory.stats()
    for a, b in [(got, ref[0]), *zip(out, ref)]:
        assert a.token_ids == b.token_ids
        assert _lps(a) == pytest.approx(_lps(b), abs=5e-3)  # batched rows: see the n-gram test
    assert _lps(got) == pytest.approx(_lps(ref[0]), abs=1e-3)
    drafted, kept = st["spec_drafted_tokens"], st["spec_accepted_tokens"]
    if target == draft:
        assert (kept >= 0.9 * drafted) if penalty == 0 else (0 < kept < drafted), (drafted, kept)
    else:
        assert drafted > 0
    assert st["draft_kv_blocks_used"] == 0 and st.get("state_rollback_slots_used", 0) == 0
    assert draft_mem.get("state_rollback_slots_used", 0) == 0


@pytest.mark.parametrize("variant", ["qwen35", "granitehybrid"])
async def test_a_hybrid_drafts_own_greedy_continuations_after_rollbacks(models, variant, monkeypatch):
    """A hybrid model drafting for itself, the target under a repetition penalty the draft does
    not apply: drafts kept in part and rolled back often, and each draft equals what the model
    alone generates greedily after the same tokens, so the draft's state after every rollback
    is exactly the kept tokens'.
    Mutation: the draft model's _sync not rolling its state back (n_computed set alone) fails it."""
    seen = record_drafts(monkeypatch)
    kw = dict(max_tokens=30, frequency_penalty=1.5, temperature=0, ignore_eos=True)
    p = prompt(4, 21)
    async with Session.open(models[variant], n_ctx=256, draft_model=models[variant], draft_p_min=0.0) as s:
        ref = await s.generate(p, speculative="off", **kw)
        got = await s.generate(p, **kw)
    assert got.token_ids == ref.token_ids
    partly = sum(0 < sum(a == b for a, b in zip(d, got.token_ids[len(t) - len(p):])) < len(d) for t, d in seen)
    assert partly >= 1, (partly, seen)
    async with Session.open(models[variant], n_ctx=256) as d:
        for tokens, proposed in seen:
            alone = await d.generate(tokens, max_tokens=len(proposed), temperature=0, ignore_eos=True)
            assert alone.token_ids == proposed, (len(tokens), proposed, alone.token_ids)
