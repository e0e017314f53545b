"""Drafts from heads that run on the target's state (runtime.draft_heads): Gemma 4's assistant
(draft_model= a gemma4-assistant GGUF, converter-made for the converted tiny gemma4). Its drafts equal
llama.cpp's (tests/parity/record_heads.py); greedy output is identical with and without it, whether its
drafts are rejected or kept, and a draft after kept ones starts from the right hidden row; an assistant
that does not fit the model is refused at open, naming the misfit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from gather import record_head_drafts, run_all

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError, ModelLoadError
from hearthlm.runtime import draft_heads as dh

DATA = Path(__file__).parent / "data" / "converted"
TARGET, HELPER = str(DATA / "gemma4.gguf"), str(DATA / "drafts" / "gemma4-assistant.gguf")
GREEDY = dict(temperature=0, ignore_eos=True, top_logprobs=1)


def _recording(monkeypatch, k: int | None = None, replace=None) -> dict[int, list[int]]:
    return record_head_drafts(monkeypatch, dh.AssistantDrafter, dh.HeadSeq, lambda self, k: dh.HeadSeq(k), k, replace)


async def test_assistant_drafts_equal_llama_cpps(monkeypatch):
    """Eight proposals of four tokens each along the target's greedy run, as llama.cpp's draft-mtp
    makes them with the assistant context on the target's (heads.json).
    Mutation: the drafts' horizon one further (seq_len = pos + 1: the target's stale slot of the
    drafted position attended) fails it; so does a draft's hidden input taken from the target's last
    row instead of the one that predicted the token, and the sliding layers reading the full layer's cache."""
    rec = json.loads((DATA / "heads.json").read_text())["gemma4_assistant"]
    seen = _recording(monkeypatch, k=4)
    async with Session.open(TARGET, n_ctx=512, draft_model=HELPER, draft_p_min=0.0) as s:
        await s.generate(rec["prompt"], max_tokens=20, **GREEDY)
    for p in rec["points"]:
        assert seen[len(p["tokens"])] == p["drafts"], len(p["tokens"])


async def test_greedy_is_identical_whether_drafts_are_rejected_or_kept(monkeypatch):
    """Plain decoding, the assistant's own drafts (random weights: all rejected), and drafts replaced by
    the target's true continuation then a wrong token (partly kept): the same tokens and log-probs; the assistant's drafts
    after kept ones equal its drafts after the same tokens in the run that kept none (so it started
    from the hidden row of the kept draft that predicted the last token).
    Mutation: observe keeping the step's last row only (d = 0, not the rows of the drafts) fails the last
    assertion (and the first test); the runner not asking for hidden rows (wants_hidden ignored) drafts nothing."""
    prompt = [2] + [5 + (i * 11) % 60 for i in range(40)]
    async with Session.open(TARGET, n_ctx=512) as s:
        ref = await s.generate(prompt, max_tokens=40, **GREEDY)
    truth = list(prompt) + ref.token_ids
    rejected = _recording(monkeypatch)
    async with Session.open(TARGET, n_ctx=512, draft_model=HELPER, draft_p_min=0.0) as s:
        got = await s.generate(prompt, max_tokens=40, **GREEDY)
        st = s.stats()
    assert got.token_ids == ref.token_ids
    assert [t[0][1] for t in got.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-4)
    assert st["spec_drafted_tokens"] >= 40 and st["draft_steps"] > 0
    def two_true(r):  # the target's next two tokens, then one it rejects: two of three drafts kept
        d = truth[len(r.tokens):len(r.tokens) + len(r.draft)]
        return d[:2] + [(t + 1) % 384 for t in d[2:3]]
    kept = _recording(monkeypatch, replace=two_true)
    async with Session.open(TARGET, n_ctx=512, draft_model=HELPER, draft_p_min=0.0) as s:
        got = await s.generate(prompt, max_tokens=40, **GREEDY)
        st = s.stats()
    assert got.token_ids == ref.token_ids
    assert [t[0][1] for t in got.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-4)
    assert st["spec_accepted_tokens"] >= 20 and st["steps"] < 25, st
    after_kept = [n for n in kept if n not in (len(prompt) + 1,) and n - 1 not in kept]  # the step before kept drafts
    assert len(after_kept) >= 3, (sorted(kept), sorted(rejected))
    for n in after_kept:
        m = min(len(kept[n]), len(rejected[n]))
        assert m and kept[n][:m] == rejected[n][:m], n


def _patched(src: str, dst: Path, key: str, change, item: int = 0) -> str:
    """A copy of the GGUF with one metadata value's bytes (an array's item) changed in place (same size)."""
    shutil.copy(src, dst)
    f = gguf.GGUFReader(src).fields[key]
    part = f.parts[f.data[item]]
    at = f.offset + sum(p.nbytes for p in f.parts[:f.data[item]])
    new = change(bytes(part.tobytes()))
    assert len(new) == part.nbytes
    with open(dst, "r+b") as out:
        out.seek(at)
        out.write(new)
    return str(dst)


async def test_an_assistant_that_does_not_fit_is_refused(tmp_path):
    """Another hidden size (an assistant made for width 48, the target's 32): ModelLoadError naming both;
    another vocabulary (one token's text changed): InvalidRequestError; the assistant opened as a model:
    ModelLoadError; "draft" asked of a session without a draft model: InvalidRequestError, and it keeps serving.
    Mutation: bind() not comparing the widths opens the session (the first assertion fails)."""
    with pytest.raises(ModelLoadError, match="hidden size 48.*32"):
        async with Session.open(TARGET, n_ctx=512, draft_model=str(DATA / "drafts" / "gemma4-assistant-wide.gguf")):
            pass
    other = _patched(HELPER, tmp_path / "vocab.gguf", "tokenizer.ggml.tokens", lambda b: b.upper(), item=7)
    with pytest.raises(InvalidRequestError, match="vocabulary|token"):
        async with Session.open(TARGET, n_ctx=512, draft_model=other):
            pass
    with pytest.raises(ModelLoadError, match="draft_model="):  # alone it has no input
        async with Session.open(HELPER, n_ctx=512):
            pass
    async with Session.open(TARGET, n_ctx=512) as s:
        with pytest.raises(InvalidRequestError, match="draft_model"):
            await s.generate([2, 5, 6], max_tokens=2, speculative="draft")
        assert len((await s.generate([2, 5, 6], max_tokens=3, **GREEDY)).token_ids) == 3


async def test_assistant_and_plain_requests_batch_together(monkeypatch):
    """Requests drafting with the assistant (the drafts then replaced by the target's next two tokens and a
    wrong one: partly kept), with n-gram drafts and not at all, at once: each one's greedy output is what it
    gets alone, and so is each of the assistant's proposals (by request and length): each draft starts
    from its own request's hidden row.
    Mutation: AssistantDrafter.observe taking every request's rows from the batch's start fails it."""
    prompts = [[2] + [5 + (i * 7 + 3 * j) % 60 for i in range(20 + 9 * j)] for j in range(5)]
    modes = [None, "off", None, "ngram", None]
    async with Session.open(TARGET, n_ctx=512) as s:
        alone = [(await s.generate(p, max_tokens=24, temperature=0, ignore_eos=True)).token_ids for p in prompts]
    truth = {tuple(p): list(p) + a for p, a in zip(prompts, alone)}
    seen: dict[tuple, list[int]] = {}
    propose = dh.AssistantDrafter.propose

    def recording(self, items):
        propose(self, items)
        for r, _ in items:
            seen[(tuple(r.prompt), len(r.tokens))] = list(r.draft)
            d = truth[tuple(r.prompt)][len(r.tokens):len(r.tokens) + len(r.draft)]
            r.draft = d[:2] + [(x + 1) % 384 for x in d[2:3]]
    monkeypatch.setattr(dh.AssistantDrafter, "propose", recording)
    runs = []
    for together in (False, True):
        seen.clear()
        async with Session.open(TARGET, n_ctx=512, draft_model=HELPER, draft_p_min=0.0) as s:
            out = [None] * len(prompts)

            async def one(i):
                out[i] = (await s.generate(prompts[i], max_tokens=24, speculative=modes[i], temperature=0,
                                           ignore_eos=True)).token_ids
            await run_all(one, len(prompts), together)
            st = s.stats()
        assert out == alone
        assert st["spec_accepted_tokens"] >= 20
        runs.append(dict(seen))
    assert len(runs[1]) >= 15 and runs[1] == runs[0]


async def test_sampled_with_the_assistant_is_a_seeded_run():
    """Sampling with the assistant's drafts (verified by rejection sampling: runtime.sampling.verify, whose
    distribution test_speculative checks): the length asked, the same run twice with a seed, drafts made.
    Mutation: the engine not handing the step's hidden rows to the assistant (draft_heads.observe a no-op)
    fails it: nothing is drafted."""
    prompt = [2] + [5 + (i * 11) % 60 for i in range(30)]
    async with Session.open(TARGET, n_ctx=512, draft_model=HELPER, draft_p_min=0.0) as s:
        a = await s.generate(prompt, max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
        b = await s.generate(prompt, max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
        st = s.stats()
    assert len(a.token_ids) == 24 and a.token_ids == b.token_ids
    assert st["spec_drafted_tokens"] > 0
