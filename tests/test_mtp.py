"""speculative="mtp": Qwen3.5's own multi-token-prediction block drafts (runtime.draft_heads.MTPDrafter)
on the converter-made tiny qwen35 (its MTP block from the spec's extra tensors). Its drafts equal
llama.cpp's (tests/parity/record_heads.py); greedy output is identical with and without, drafts rejected
or kept, and a draft after kept ones is what the block drafts after the same tokens when none were kept
(its rows of kept drafts recomputed from the target's hidden states); a model without the block refuses
"mtp" and keeps serving. Qwen3.5 is a hybrid: its recurrent state is rolled back past rejected drafts
(runtime.seq_memory)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gather import record_head_drafts, run_all

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError
from hearthlm.runtime import draft_heads as dh

DATA = Path(__file__).parent / "data" / "converted"
QWEN35 = str(DATA / "qwen35.gguf")
GREEDY = dict(temperature=0, ignore_eos=True, top_logprobs=1)


def _recording(monkeypatch, k: int | None = None, replace=None) -> dict[int, list[int]]:
    return record_head_drafts(monkeypatch, dh.MTPDrafter, dh.MTPSeq, lambda self, k: dh.MTPSeq(k, self, self.n_embd), k, replace)


def _block_keys(monkeypatch, replace=None) -> dict[int, np.ndarray]:
    """After each proposal, by the request's token count: the block's K rows of the positions it counts
    as computed from the target's hidden states (MTPSeq.valid); `replace(r)`: the drafts then verified."""
    keys: dict[int, np.ndarray] = {}
    propose = dh.MTPDrafter.propose

    def recording(self, items):
        propose(self, items)
        kv, bs = self.memory.kv, self.memory.block_size
        for r, _ in items:
            blocks, n = r.spec.seq.blocks, r.spec.valid
            keys[len(r.tokens)] = np.asarray(kv.k[0])[[blocks[p // bs] * bs + p % bs for p in range(n)]].astype(np.float32)
            if replace is not None:
                r.draft = replace(r)
    monkeypatch.setattr(dh.MTPDrafter, "propose", recording)
    return keys


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
async def test_mtp_drafts_equal_llama_cpps(monkeypatch, arch):
    """Eight proposals of four tokens along the target's greedy run, as llama.cpp's draft-mtp makes them
    (heads.json), for the dense block and the MoE one (its FFN the experts and the shared expert); the
    drafts are then dropped, so the target runs as without them.
    Mutation: the block's row q taking the target's row q (not q - 1) fails it; so does the hidden half
    normed by enorm (not hnorm)."""
    rec = json.loads((DATA / "heads.json").read_text())[f"{arch}_mtp"]
    seen = _recording(monkeypatch, k=4, replace=lambda r: [])
    async with Session.open(str(DATA / f"{arch}.gguf"), n_ctx=512, draft_p_min=0.0) as s:
        got = await s.generate(rec["prompt"], max_tokens=20, speculative="mtp", **GREEDY)
    assert got.token_ids[:8] == [p["tokens"][-1] for p in rec["points"]]
    for p in rec["points"]:
        assert seen[len(p["tokens"])] == p["drafts"], len(p["tokens"])


async def test_mtp_greedy_is_identical_whether_drafts_are_rejected_or_kept(monkeypatch):
    """Plain decoding, the block's own drafts (random weights: mostly rejected), and drafts replaced by the
    target's next two tokens then a wrong one (two of three kept): the same tokens and log-probs; after
    kept drafts, the block's K rows of the tokens so far equal those of the run that kept none at the same
    length (its rows of the kept drafts' positions redone from the target's hidden states at the kept rows).
    Mutation: greedy verification keeping every draft (sampling.verify returning the draft) fails it.
    Not caught here: the block without the target's hidden rows (zeros: it still drafts, the same in both
    runs), and the rows of its own kept drafts not redone (see the fresh-run test for that)."""
    prompt = [2] + [5 + (i * 11) % 60 for i in range(40)]
    async with Session.open(QWEN35, n_ctx=512) as s:
        ref = await s.generate(prompt, max_tokens=40, **GREEDY)
    truth = list(prompt) + ref.token_ids

    def two_true(r):
        d = truth[len(r.tokens):len(r.tokens) + len(r.draft)]
        return d[:2] + [(t + 1) % 384 for t in d[2:3]]
    runs = []
    for replace in (None, two_true):
        keys = _block_keys(monkeypatch, replace=replace)
        async with Session.open(QWEN35, n_ctx=512, draft_p_min=0.0) as s:
            got = await s.generate(prompt, max_tokens=40, speculative="mtp", **GREEDY)
            st = s.stats()
        assert got.token_ids == ref.token_ids
        assert [t[0][1] for t in got.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-4)
        assert st["spec_drafted_tokens"] >= 20 and st["mtp_steps"] > 0
        assert st["kv_blocks_used"] == 0 and st["mtp_kv_blocks_used"] == 0  # the block's K/V released too
        runs.append((keys, st))
    (rejected, _), (kept, st) = runs
    assert st["spec_accepted_tokens"] >= 20 and st["steps"] < 25, st
    after_kept = [n for n in kept if n != len(prompt) + 1 and n - 1 not in kept]
    assert len(after_kept) >= 3
    for n in after_kept:
        np.testing.assert_allclose(kept[n], rejected[n], atol=2e-3, err_msg=str(n))


async def test_mtp_without_heads_is_refused_and_the_session_keeps_serving():
    """A model with no MTP block (the tiny gemma4): InvalidRequestError naming it; the next request runs.
    Mutation: submit not checking for the drafter (None.new_seq()) fails it."""
    async with Session.open(str(DATA / "gemma4.gguf"), n_ctx=512) as s:
        with pytest.raises(InvalidRequestError, match="multi-token-prediction"):
            await s.generate([2, 5, 6], max_tokens=2, speculative="mtp")
        assert len((await s.generate([2, 5, 6], max_tokens=3, **GREEDY)).token_ids) == 3




async def test_the_blocks_rows_after_its_own_kept_drafts_are_a_fresh_runs(monkeypatch):
    """Every draft kept (verification patched to keep it: the block's own drafts become the tokens): after
    each proposal, the block's K/V rows of the kept tokens equal those of a fresh request over the same
    tokens (its prompt all but the last, the last forced by logit_bias), whose rows all come from the
    target's hidden states: the rows it computed from its own hidden state when drafting were redone.
    Mutation: _sync not capping at `valid` (those rows kept) fails it (the drafts alone do not tell: on
    these weights they come out the same)."""
    import hearthlm.runtime.output as output
    monkeypatch.setattr(output, "verify", lambda lg, p, rng, history, d: (d, True))
    monkeypatch.setattr(dh.MTPDrafter, "new_seq", lambda self: dh.MTPSeq(3, self, self.n_embd))
    monkeypatch.setattr(dh.MTPSeq, "feedback", lambda self, n, kept: None)
    prompt = [2] + [5 + (i * 11) % 60 for i in range(30)]
    keys = _block_keys(monkeypatch)
    async with Session.open(QWEN35, n_ctx=512, draft_p_min=0.0) as s:
        tokens = list(prompt) + (await s.generate(prompt, max_tokens=24, speculative="mtp", temperature=0,
                                                  ignore_eos=True)).token_ids
        st = s.stats()
    assert st["spec_accepted_tokens"] >= 12, st
    runs = {n: k for n, k in keys.items() if n > len(prompt) + 1}
    assert len(runs) >= 4
    for n in sorted(runs)[:3]:  # a session each: no prefix of the target's or the block's taken from a cache
        keys.clear()
        async with Session.open(QWEN35, n_ctx=512, draft_p_min=0.0) as s:
            await s.generate(tokens[:n - 1], max_tokens=5, speculative="mtp", temperature=0, ignore_eos=True,
                             logit_bias={tokens[n - 1]: 100.0})
        assert runs[n].shape[0] == n and keys[n].shape == runs[n].shape
        np.testing.assert_allclose(runs[n], keys[n], atol=2e-3, err_msg=str(n))


async def test_mtp_and_plain_requests_batch_together(monkeypatch):
    """Requests speculating with the block, with n-gram drafts and not at all, one after another and
    at once: each one's greedy output is what it gets alone, and so is each of the block's proposals
    (by request and length): its rows come from its own request's hidden states.
    Mutation: MTPDrafter.observe appending the batch's first rows (hidden[0:k]) for every request fails it."""
    prompts = [[2] + [5 + (i * 7 + 3 * j) % 60 for i in range(20 + 9 * j)] for j in range(5)]
    modes = ["mtp", "off", "mtp", "ngram", "mtp"]
    seen: dict[tuple, list[int]] = {}
    propose = dh.MTPDrafter.propose

    def recording(self, items):
        propose(self, items)
        for r, _ in items:
            seen[(tuple(r.prompt), len(r.tokens))] = list(r.draft)
    monkeypatch.setattr(dh.MTPDrafter, "propose", recording)
    runs = []
    for together in (False, True):
        seen.clear()
        async with Session.open(QWEN35, n_ctx=512, draft_p_min=0.0) as s:
            out = [None] * len(prompts)

            async def one(i):
                out[i] = (await s.generate(prompts[i], max_tokens=24, speculative=modes[i], temperature=0,
                                           ignore_eos=True)).token_ids
            await run_all(one, len(prompts), together)
            plain = [(await s.generate(p, max_tokens=24, temperature=0, ignore_eos=True)).token_ids for p in prompts]
            st = s.stats()
        assert out == plain
        assert st["mtp_steps"] > 0 and st["mtp_kv_blocks_used"] == 0
        runs.append(dict(seen))
    # the same proposals, as far as both go (batched, the session's rollback slots may shorten a draft, and
    # the draft length adapts to what was kept)
    common = [key for key in runs[1] if key in runs[0]]
    assert len(common) >= 15
    for key in common:
        m = min(len(runs[0][key]), len(runs[1][key]))
        assert runs[0][key][:m] == runs[1][key][:m], key


async def test_the_block_is_opened_at_its_first_draft():
    """A Qwen3.5 session that never asks for "mtp" makes no runner or K/V for the block (no second packed
    LM head); the first "mtp" request makes them.
    Mutation: MTPDrafter opening its memory and runner in __init__ fails it."""
    async with Session.open(QWEN35, n_ctx=512) as s:
        await s.generate([2, 5, 6, 7], max_tokens=4, **GREEDY)
        assert s.engine.mtp.runner is None and s.stats()["mtp_kv_blocks_total"] == 0
        await s.generate([2, 5, 6, 7], max_tokens=4, speculative="mtp", **GREEDY)
        assert s.engine.mtp.runner is not None and s.stats()["mtp_steps"] > 0


async def test_sampled_tokens_with_mtp_drafts_are_scored_by_the_plain_model(monkeypatch):
    """Sampled output with the block drafting (its drafts then replaced by the greedy run's continuation:
    some kept, some rejected once the sample leaves it): at every generated position the top log-probs
    reported equal the plain model's for the same prefix (the prompt log-probs of prompt + output), so
    each token was drawn by rejection sampling (test_speculative: the target's distribution) from the
    right state. Mutation: SequenceMemory.rollback leaving the recurrent state after the rejected drafts
    fails it."""
    p = [2] + [5 + (i * 11) % 60 for i in range(24)]
    async with Session.open(QWEN35, n_ctx=512, draft_p_min=0.0) as s:
        greedy = await s.generate(p, max_tokens=30, **GREEDY)
        truth = list(p) + greedy.token_ids
        _recording(monkeypatch, replace=lambda r: [t for t in truth[len(r.tokens):len(r.tokens) + len(r.draft)]]
                   if r.tokens == truth[:len(r.tokens)] else r.draft)
        got = await s.generate(p, max_tokens=30, temperature=0.4, seed=11, ignore_eos=True, top_logprobs=3,
                               speculative="mtp")
        st = s.stats()
        scored = await s.generate(p + got.token_ids, max_tokens=0, prompt_logprobs=3)
    assert 0 < st["spec_accepted_tokens"] < st["spec_drafted_tokens"]
    assert got.token_ids != greedy.token_ids
    plain = scored.prompt_logprobs[len(p):]
    assert len(plain) == len(got.top_logprobs)
    for i, (a, b) in enumerate(zip(got.top_logprobs, plain)):
        want = {t: lp for t, lp in (b[2] or [])}
        for t, lp in a:
            assert t in want and abs(lp - want[t]) < 5e-3, (i, a, b)
