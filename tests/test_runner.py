"""The model runner (runtime.runner) alone, on a tiny synthetic llama over the reference
backend: a mixed batch's inputs (tokens, positions, KV slots, block tables, output rows,
padding), its logits independent of the batch it runs in, hidden rows for embeddings, and
the thread choice a draft model's runner leaves alone. Each test names the mutation of
runtime/runner.py it was seen to fail on."""
from __future__ import annotations

import numpy as np
import pytest
from synth import DIMS, FakeModel

from hearthlm.backends.reference import ReferenceBackend
from hearthlm.core.errors import InvalidRequestError
from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import ModelRunner, open_memory
from hearthlm.runtime.sampling import SamplingParams

BS = 4


def runner(backend=None, **kw) -> ModelRunner:
    model = FakeModel("llama", n_layer=2)
    place = Placement.single(backend or ReferenceBackend(), model.n_layer)
    mem = open_memory(model, place, n_ctx=64, kv_blocks=32, block_size=BS, max_seqs=4)
    return ModelRunner(model, place, mem, n_ctx=64, max_batch_tokens=64, max_seqs=4, **kw)


def admitted(run: ModelRunner, prompt, kind=Kind.GENERATE, **kw) -> Request:
    r = Request(prompt=list(prompt), params=SamplingParams(temperature=0.0), kind=kind,
                max_tokens=4 if kind is Kind.GENERATE else 0, on_token=lambda t, lp: None,
                on_finish=lambda reason, err: None, **kw)
    assert run.memory.admit(r) and run.memory.grow(r, len(prompt) + 4)
    return r


def test_a_mixed_batch_is_laid_out_as_planned():
    """A decoding request with a 2-token draft (3 tokens, 3 output rows), a prompt chunk that
    does not end its prompt (no output row) and a scored prompt (one row per scored position).
    Mutations caught: only the last of a draft's rows output (`- len(r.draft)` dropped);
    positions not starting at n_computed; KV slots ignoring the block table; seq_off as the
    running sum of k including each row's own (`np.cumsum(k[:-1])` made `k[1:]`); seq_len
    without this step's tokens (`done + k` made `done`)."""
    run = runner()
    dec = admitted(run, [3, 4, 5, 6, 7, 8])
    dec.n_computed, dec.draft = 5, [9, 10]
    chunk = admitted(run, list(range(11, 20)))
    score = admitted(run, [1, 2, 3, 4], Kind.SCORE, prompt_logprobs=0)
    plan = StepPlan([Scheduled(dec, 3, True), Scheduled(chunk, 5, False), Scheduled(score, 4, True)], [])
    feed, shape = run.inputs(plan)
    n = plan.n_tokens  # 12
    assert feed["tokens"][:n].tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4]
    assert feed["pos"][:n].tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert feed["tok_seq"][:n].tolist() == [0] * 3 + [1] * 5 + [2] * 4
    for i, r in enumerate([dec, chunk, score]):
        assert feed["block_table"][i, :len(r.blocks)].tolist() == r.blocks
    want = [r.blocks[p // BS] * BS + p % BS for r, ps in [(dec, [5, 6, 7]), (chunk, range(5)), (score, range(4))]
            for p in ps]
    assert feed["slots"][:n].tolist() == want
    scratch = run.memory.scratch_block  # padding writes the scratch block only
    assert all(s // BS == scratch for s in feed["slots"][n:]) and shape.n_tokens == 16
    assert shape.n_out >= 6 and feed["out_rows"].tolist() == [0, 1, 2, 8, 9, 10] + [0] * (shape.n_out - 6)
    assert not shape.embd
    # each row's token range (recurrent layers), each token's horizon; padding tokens in a padding row
    assert feed["seq_off"].tolist() == [0, 3, 8] + [n] * (shape.n_seqs - 2)
    assert feed["seq_len"].tolist() == [8] * 3 + [5] * 5 + [4] * 4 + [1] * (shape.n_tokens - n)
    assert shape.n_seqs > 3 and feed["tok_seq"][n:].tolist() == [3] * (shape.n_tokens - n)


def test_a_decode_step_takes_the_fast_path_with_the_same_inputs(monkeypatch):
    """Steps of 1-4 sequences each decoding one token, at positions across block boundaries,
    with and without a recurrent-state snapshot asked for after the token: runner.inputs' fast
    path (_decode_inputs) gives the general path's arrays exactly, and a step with a draft, a
    scored prompt or an image does not take it. Mutations seen to fail: the fast path's slots
    from the position's block + 1 (`done // bs + 1`); seq_len without this step's token; the
    padding rows' tok_seq 0 where a padding sequence row exists; the snapshot slot taken for
    the token before."""
    from hearthlm.runtime import runner as runner_mod
    run = runner()
    g = np.random.default_rng(3)
    for trial in range(40):
        reqs = []
        for _ in range(int(g.integers(1, 5))):
            n_prompt = int(g.integers(1, 12))
            r = admitted(run, g.integers(1, 50, n_prompt).tolist())
            r.n_computed = n_prompt - 1
            if trial % 3 == 0:
                r.state_snaps = {r.n_computed + int(g.integers(0, 3)): int(g.integers(1, 9))}
            reqs.append(r)
        plan = StepPlan([Scheduled(r, 1, True) for r in reqs], [])
        assert all(runner_mod._plain_decode(s) for s in plan.seqs)
        fast, shape = run.inputs(plan)
        monkeypatch.setattr(runner_mod, "_plain_decode", lambda s: False)
        slow, shape2 = run.inputs(plan)
        monkeypatch.undo()
        assert shape == shape2
        assert fast.keys() == slow.keys()
        for k in slow:
            assert fast[k].dtype == slow[k].dtype and fast[k].tolist() == slow[k].tolist(), (trial, k)
        for r in reqs:
            run.memory.release(r)
    dec = admitted(run, [3, 4, 5])
    dec.n_computed = 2
    for name, value in (("draft", [7]), ("prompt_logprobs", 0), ("max_tokens", 0), ("media", [object()])):
        r = admitted(run, [3, 4, 5])
        r.n_computed = 2
        setattr(r, name, value)
        assert not runner_mod._plain_decode(Scheduled(r, 1, True)), name
        run.memory.release(r)
    assert runner_mod._plain_decode(Scheduled(dec, 1, True))
    assert not runner_mod._plain_decode(Scheduled(dec, 1, False))


def test_logits_do_not_depend_on_the_batch():
    """A prompt's last-row logits alone, and beside another prompt (before it in the batch):
    the same. Mutations caught: every token given sequence row 0 (`tok_seq[off:off + k] = 0`:
    the second prompt attends to the first's K/V); output rows counted from the batch's
    start instead of each request's offset."""
    run = runner()
    a = admitted(run, [5, 6, 7, 8, 9])
    alone = run.run(StepPlan([Scheduled(a, 5, True)], [])).logits[0]
    run.memory.release(a)
    b, a = admitted(run, [1, 2, 3]), admitted(run, [5, 6, 7, 8, 9])
    out = run.run(StepPlan([Scheduled(b, 3, True), Scheduled(a, 5, True)], [])).logits
    assert out.shape[1] == DIMS["n_vocab"]
    assert np.allclose(out[1], alone, atol=1e-5) and not np.allclose(out[0], alone, atol=1e-3)


def test_embeddings_get_hidden_rows():
    """A batch with an embedding outputs every token's final hidden state and no logits rows
    for it. Mutation caught: `embd` set only for ranking requests (no hidden rows come back)."""
    run = runner()
    e = admitted(run, [1, 2, 3], Kind.EMBED, pooling="mean")
    out = run.run(StepPlan([Scheduled(e, 3, True)], []))
    assert out.hidden is not None and out.hidden.shape[0] >= 3 and out.hidden.shape[1] == DIMS["n_embd"]
    assert out.logits.shape[0] == 0


class Counting(ReferenceBackend):
    """Two thread counts, and a record of the counts set."""

    def __init__(self):
        super().__init__()
        self.used = []

    def thread_counts(self):
        return (2, 1)

    def use_threads(self, n):
        self.used.append(n)

    def after_step(self, n, slow):
        return False


@pytest.mark.parametrize("tune", [True, False])
def test_a_draft_runner_leaves_the_threads_alone(tune):
    """The target's runner picks the host's threads per step; a draft model's (tune_threads
    False) runs on whatever its target picked. Mutation caught: tune_threads ignored (the
    draft's steps would switch the shared backend's threads under the target's measurements)."""
    be = Counting()
    run = runner(be, tune_threads=tune)
    r = admitted(run, [1, 2, 3])
    run.run(StepPlan([Scheduled(r, 3, True)], []))
    assert be.used == ([2] if tune else [])
    assert run.stats()["threads"] == (2 if tune else None)


def test_a_cache_too_big_for_its_backend_is_refused_at_open():
    """open_memory refuses a KV cache larger than the backend says it has, and takes one that
    just fits. Mutation caught: the check's bytes counted for K only (a cache of twice the
    room passes)."""
    model = FakeModel("llama", n_layer=2)
    kw = dict(n_ctx=60, kv_blocks=15, block_size=4)
    mem = open_memory(model, Placement.single(ReferenceBackend(), 2), **kw)
    need = sum(a.nbytes for a in [*mem.kv.k, *mem.kv.v])

    class Small(ReferenceBackend):
        def memory_available(self):
            return self.room
    be = Small()
    be.room = need
    open_memory(model, Placement.single(be, 2), **kw)
    be.room = need - 1
    with pytest.raises(InvalidRequestError, match="KV cache"):
        open_memory(model, Placement.single(be, 2), **kw)
