"""The output processor (runtime.output) alone, on hand-made logits and hidden rows: greedy
tokens and the stops (end-of-generation, stop ids, length), draft verification and the
draft tokens kept, grammar masks per row, forced tokens, prompt scoring, pooling over chunks,
the order in which a mixed batch's rows are read, and a request's failure kept to itself.
Each test names the mutation of runtime/output.py it was seen to fail on."""
from __future__ import annotations

import numpy as np
import pytest

from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.constraint import GrammarError
from hearthlm.runtime.output import OutputProcessor
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import Picks, StepOutput
from hearthlm.runtime.sampling import LSE_ROWS, SamplingParams, log_softmax

V, EOG = 10, 9


def request(kind=Kind.GENERATE, prompt=(1, 2, 3), max_tokens=8, **kw) -> Request:
    params = kw.pop("params", SamplingParams(temperature=0.0))
    return Request(prompt=list(prompt), params=params, max_tokens=max_tokens, kind=kind,
                   on_token=lambda t, lp: None, on_finish=lambda reason, err: None, **kw)


def decoding(r: Request, draft=()) -> Scheduled:
    """r at its last token (and a draft after it): one row, and one per draft token."""
    r.n_computed, r.draft = len(r.tokens) - 1, list(draft)
    return Scheduled(r, 1 + len(r.draft), True)


def rows(*best: int) -> np.ndarray:
    """(len(best), V) logits whose argmax in row j is best[j] (the next best is best[j] - 1)."""
    lg = np.tile(-np.arange(V, dtype=np.float32) / V, (len(best), 1))
    for j, t in enumerate(best):
        lg[j, t] = 5.0
        lg[j, (t - 1) % V] = 4.0
    return lg


def process(seqs: list[Scheduled], logits, hidden=None, masks=None, proc=None):
    proc = proc or OutputProcessor(V, frozenset({EOG}), n_ctx=64)
    return proc.process(StepPlan(seqs, []), StepOutput(np.asarray(logits, np.float32), hidden), masks or {})


class FakeMatcher:
    """A grammar stand-in: the mask given is applied as Matcher.apply does."""

    def __init__(self, forced=()):
        self.taken, self._forced, self.done = [], list(forced), False

    def apply(self, logits, allowed):
        return np.where(allowed, logits, np.float32(-np.inf))

    def consume(self, t):
        self.taken.append(t)

    def forced(self, room):
        return self._forced[:room]


def test_greedy_tokens_and_the_stops():
    """The argmax is appended and delivered; end-of-generation and a stop id finish "stop"
    undelivered (ignore_eos delivers it); max_tokens finishes "length" with its last token.
    Mutations caught: the end-of-generation check moved after the append (EOG delivered);
    `n_generated >= max_tokens` made `>` (one token too many)."""
    r = request()
    (o,) = process([decoding(r)], rows(4))
    assert o.tokens == [(4, None)] and o.finish is None and r.tokens[-1] == 4 and r.n_generated == 1
    (o,) = process([decoding(r)], rows(EOG))
    assert o.tokens == [] and o.finish == "stop" and r.tokens[-1] == 4
    r = request(params=SamplingParams(temperature=0.0, ignore_eos=True))
    (o,) = process([decoding(r)], rows(EOG))
    assert o.tokens == [(EOG, None)] and o.finish is None
    r = request(params=SamplingParams(temperature=0.0, stop_token_ids=(4,)))
    (o,) = process([decoding(r)], rows(4))
    assert o.tokens == [] and o.finish == "stop"
    r = request(max_tokens=2)
    assert process([decoding(r)], rows(4))[0].finish is None
    (o,) = process([decoding(r)], rows(5))
    assert o.tokens == [(5, None)] and o.finish == "length"


def test_a_draft_keeps_the_prefix_the_target_agrees_with():
    """Draft [2, 5, 6] over rows whose argmaxes are 2, 5, 1, 0: tokens 2, 5 and the target's 1
    (its choice after them); 2 draft tokens kept (their K/V computed this step), 3 drafted, 2
    accepted. Mutation caught: counting a draft token kept before checking the target agreed
    (kept 3, so the rejected token's K/V would be kept)."""
    proc = OutputProcessor(V, frozenset({EOG}), n_ctx=64)
    r = request()
    (o,) = process([decoding(r, [2, 5, 6])], rows(2, 5, 1, 0), proc=proc)
    assert [t for t, _ in o.tokens] == [2, 5, 1] and o.kept == 2 and o.finish is None
    assert proc.counters == dict(tokens_generated=3, spec_drafted_tokens=3, spec_accepted_tokens=2)
    r = request()  # all agreed: the bonus row's token follows
    (o,) = process([decoding(r, [2, 5])], rows(2, 5, 7))
    assert [t for t, _ in o.tokens] == [2, 5, 7] and o.kept == 2


def test_each_row_has_its_own_grammar_mask():
    """Row j of a constrained draft is masked by mask row j: row 1's argmax (6) is banned there,
    so the draft's 5 (its next best) is verified. Mutation caught: every row masked by the
    first mask row (row 1 keeps 6, the draft is cut at 1 token)."""
    m = FakeMatcher()
    r = request(matcher=m)
    masks = np.ones((3, V), bool)
    masks[1, 6] = False
    masks[0, 5] = False
    (o,) = process([decoding(r, [2, 5])], rows(2, 6, 3), masks={id(r): masks})
    assert [t for t, _ in o.tokens] == [2, 5, 3] and o.kept == 2
    assert m.taken == [2, 5, 3]  # the grammar took each token in


def test_forced_tokens_follow_and_end_the_draft():
    """A grammar forcing token 8 after the first: it is appended unsampled, and the rest of the
    draft is dropped (its rows followed other tokens). Mutation caught: going on verifying
    after forced tokens (`not ok or forced` made `not ok`: the second draft token kept)."""
    r = request(matcher=FakeMatcher(forced=[8]))
    (o,) = process([decoding(r, [2, 5])], rows(2, 5, 3), masks={id(r): np.ones((3, V), bool)})
    assert [t for t, _ in o.tokens] == [2, 8] and o.kept == 0 and r.tokens[-2:] == [2, 8]


def test_a_mixed_batch_is_read_in_the_runners_row_order():
    """Score (3 scored rows), generate (1), rank (1), embed (hidden rows, none of the logits):
    each reads its own rows. Mutation caught: the scored rows not stepped over (the generation
    sampled from the score request's first row, and the ranking read the wrong row)."""
    score = request(Kind.SCORE, prompt=(1, 2, 3, 4), max_tokens=0, prompt_logprobs=0)
    gen = request(prompt=(5, 6))
    rank = request(Kind.RANK, prompt=(1, 2, 3), max_tokens=0)
    emb = request(Kind.EMBED, prompt=(4, 5), max_tokens=0, pooling="mean")
    seqs = [Scheduled(score, 4, True), decoding(gen), Scheduled(rank, 3, True), Scheduled(emb, 2, True)]
    logits = np.concatenate([rows(1, 1, 1), rows(7), rows(3)])
    hidden = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)  # 4 + 1 + 3 + 2 tokens
    outs = process(seqs, logits, hidden)
    assert [o.finish for o in outs] == ["stop", None, "stop", "stop"]
    assert [x for x, _ in score.prompt_lps] == pytest.approx([log_softmax(logits[j])[j + 2] for j in range(3)])
    assert outs[1].tokens == [(7, None)]
    assert np.array_equal(rank.pooled, logits[4])
    assert np.allclose(emb.pooled, hidden[8:10].mean(0))


def test_scored_log_probs_are_log_softmax_bit_for_bit():
    """A scored prompt's log-probs over a 262K vocabulary, more rows than logsumexp_rows takes at
    a time: each the very float64 that log_softmax of its row gives, and the k alternatives'
    too. Mutations seen to fail: the block's rows offset by one (`x[i + 1:...]`, held in range); the max not
    taken off before exp; the row sums in float32."""
    n = 2 * LSE_ROWS + 3
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((n, 262144)) * 30).astype(np.float32)
    prompt = tuple(int(t) for t in rng.integers(0, 262144, n + 1))
    r = request(Kind.SCORE, prompt=prompt, max_tokens=0, prompt_logprobs=2)
    OutputProcessor.score_prompt(r, range(0, n), logits)
    want = [float(log_softmax(logits[j])[prompt[j + 1]]) for j in range(n)]
    assert [x for x, _ in r.prompt_lps] == want
    assert all(alts[-1] == (prompt[j + 1], want[j]) or (prompt[j + 1], want[j]) in alts
               for j, (_, alts) in enumerate(r.prompt_lps))


@pytest.mark.parametrize("pooling, want", [("mean", lambda h: h.mean(0)), ("cls", lambda h: h[0]),
                                           ("last", lambda h: h[-1])])
def test_pooling_folds_a_prompt_over_chunks(pooling, want):
    """An embedding computed in two chunks pools as if in one, finishing at the last chunk.
    Mutations caught: the mean divided by the last chunk's length (not the prompt's); cls
    taking a later chunk's first row."""
    h = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    r = request(Kind.EMBED, prompt=(1, 2, 3, 4, 5), max_tokens=0, pooling=pooling)
    (o,) = process([Scheduled(r, 3, False)], np.zeros((0, V)), h[:3])
    assert o.finish is None
    r.n_computed = 3
    (o,) = process([Scheduled(r, 2, True)], np.zeros((0, V)), h[3:])
    assert o.finish == "stop" and np.allclose(r.pooled, want(h.astype(np.float64)))


def test_a_failing_request_fails_alone(monkeypatch):
    """A grammar error and a sampler error each end their own request with an error; their
    neighbour samples as usual. Mutation caught: the per-request guard in emit removed (the
    exception escapes process and the engine fails the whole batch)."""
    from hearthlm.runtime import output

    class Broken(FakeMatcher):
        def apply(self, logits, allowed):
            raise GrammarError("the grammar allows no token here")
    real = output.sample
    monkeypatch.setattr(output, "sample", lambda lg, p, rng, hist: 1 // 0 if p.seed == 1 else real(lg, p, rng, hist))
    bad, nan, ok = request(matcher=Broken()), request(params=SamplingParams(seed=1)), request()
    masks = {id(bad): np.ones((1, V), bool)}
    outs = process([decoding(bad), decoding(nan), decoding(ok)], rows(1, 2, 3), masks=masks)
    assert outs[0].finish == "error" and isinstance(outs[0].error, GrammarError)
    assert outs[1].finish == "error" and "sampling failed" in str(outs[1].error)
    assert outs[2].tokens == [(3, None)] and outs[2].finish is None


def test_join_masks_gives_each_request_its_rows():
    """The worker's mask rows are split per constrained request: one, plus one per draft
    token. Mutation caught: one row per request (the second request would get the first's
    draft rows)."""
    proc = OutputProcessor(V, frozenset({EOG}), n_ctx=64)
    a, b = request(matcher=FakeMatcher()), request(matcher=FakeMatcher())
    plan = StepPlan([decoding(a, [1, 2]), decoding(b)], [])
    filled = np.arange(4)[:, None] == np.arange(V)  # row i allows token i only

    class Worker:
        def start(self, matchers, drafts):
            assert drafts == [[1, 2], []]
            return "job"

        def join(self, job):
            return filled
    proc._masks = Worker()
    got = proc.join_masks(proc.start_masks(plan))
    assert np.array_equal(got[id(a)], filled[:3]) and np.array_equal(got[id(b)], filled[3:])
    assert proc.start_masks(StepPlan([decoding(request())], [])) is None


def test_a_requests_kind_and_fields_agree():
    """The kind is set where a request is made, and its fields must agree with it: a ranking
    pools by "rank" (sequence memory reuses no prefix for it), an embedding names its pooling,
    only a generation has max_tokens, a score asks for prompt log-probs. Mutations caught
    (runtime/request.py): RANK not setting its pooling; the embedding's pooling unchecked."""
    from hearthlm.core.errors import InvalidRequestError
    assert request(Kind.RANK, max_tokens=0).pooling == "rank"
    assert request(Kind.EMBED, max_tokens=0, pooling="cls").kind is Kind.EMBED
    assert request(kind="generate").kind is Kind.GENERATE and Kind.EMBED.pools and not Kind.SCORE.pools
    for kind, kw in [(Kind.EMBED, {}), (Kind.EMBED, dict(pooling="rank")), (Kind.GENERATE, dict(pooling="mean")),
                     (Kind.SCORE, {}), (Kind.PREFILL, dict(max_tokens=3))]:
        with pytest.raises(InvalidRequestError):
            request(kind, **{"max_tokens": 0, **kw})
    with pytest.raises(TypeError):  # no default: every maker says what it wants
        Request(prompt=[1], params=SamplingParams(), max_tokens=1, on_token=None, on_finish=None)


def test_rows_by_rule_choose_as_emit_does(monkeypatch):
    """A batch of plain requests (greedy and seeded sampling, one wanting EOG, one at its last
    token) interleaved with ones emit handles (a draft, penalties, top log-probs, min_tokens
    banning EOG): their tokens, finishes and generators' states are what emit alone gives each.
    Mutations: the greedy rows' argmax read from the first len(rows) rows (not their own) fails
    it; so does plain() ignoring min_tokens (the banned EOG taken by rule, finishing "stop")."""
    import hearthlm.runtime.output as output_mod
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((12, V)) * 2).astype(np.float32)
    logits[6, EOG] = logits[8, EOG] = 30.0  # request 5's row and request 7's (a draft takes 2 rows)

    def batch():
        sampled = dict(temperature=0.9, top_k=5, top_p=0.95, min_p=0.0)
        reqs = [request(), request(params=SamplingParams(**sampled, seed=1)),
                request(params=SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=(1, 2, 3, 4)),
                request(), request(params=SamplingParams(temperature=0.0, top_logprobs=2)),
                request(), request(params=SamplingParams(**sampled, seed=2), max_tokens=1),
                request(params=SamplingParams(temperature=0.0, min_tokens=3))]
        seqs = [decoding(r, [3] if i == 3 else []) for i, r in enumerate(reqs)]  # request 3 drafts a token
        return reqs, seqs

    got_reqs, seqs = batch()
    got = process(seqs, logits)
    monkeypatch.setattr(output_mod, "plain", lambda r: False)
    want_reqs, seqs = batch()
    want = process(seqs, logits)
    assert [(o.tokens, o.finish, o.kept) for o in got] == [(o.tokens, o.finish, o.kept) for o in want]
    assert [r.tokens for r in got_reqs] == [r.tokens for r in want_reqs]
    assert [got_reqs[i].rng.random() for i in (1, 6)] == [want_reqs[i].rng.random() for i in (1, 6)]  # the seeded
    assert got[5].finish == "stop" and got[7].finish is None and got[6].finish == "length"


def test_picks_only_where_every_output_row_is_by_rule():
    """A step is asked for picks (each output row's k largest logits, taken where the logits are)
    when each of its output rows is a generation's next token by rule: k 1 where greedy, its
    top_k where sampled; a prompt chunk that wants no row does not stop it. Mutations seen to
    fail: the greedy check dropped (a sampled row asking for 1), the draft check dropped,
    `plain` not asked (a logit bias ignored), scored prompt positions not checked (their
    log-probs need the logits), top_k 0 (off) or >= the vocabulary taken as a pick."""
    proc = OutputProcessor(V, frozenset({EOG}), n_ctx=64)
    plan = lambda *seqs: StepPlan(list(seqs), [])
    picks = lambda *seqs: (lambda ks: None if ks is None else ks.tolist())(proc.picks(plan(*seqs)))
    chunk = Scheduled(request(prompt=range(1, 9)), 4, False)  # a prompt's first chunk: no output row
    sampled = lambda k: request(params=SamplingParams(temperature=0.8, top_k=k))
    assert picks(decoding(request()), decoding(request()), chunk) == [1, 1]
    assert picks(decoding(request()), decoding(sampled(3)), decoding(request())) == [1, 3, 1]
    assert picks(chunk) == []
    assert picks(decoding(request()), decoding(sampled(0))) is None  # top_k off: every logit is a candidate
    assert picks(decoding(sampled(V))) is None
    assert picks(decoding(request(), draft=[3])) is None
    assert picks(decoding(request(params=SamplingParams(temperature=0.0, logit_bias={3: 5.0})))) is None
    assert picks(decoding(request(params=SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.1)))) is None
    assert picks(decoding(request(params=SamplingParams(temperature=0.0, top_logprobs=2)))) is None
    scored = request(prompt=(1, 2, 3, 4), prompt_logprobs=0)  # a generation that scores its prompt too
    assert picks(decoding(request()), Scheduled(scored, 4, True)) is None
    assert picks(Scheduled(request(kind=Kind.EMBED, max_tokens=0, pooling="mean"), 3, True)) is None


def test_greedy_tokens_from_the_steps_ids_without_logits():
    """With picks (logits None), greedy rows take the step's ids, and stops apply as before.
    Mutation seen to fail: emit_by_rule reading the logits regardless (None: a TypeError, the
    request failed)."""
    a, b = request(), request(params=SamplingParams(temperature=0.0, stop_token_ids=[4]))
    out = OutputProcessor(V, frozenset({EOG}), n_ctx=64).process(
        StepPlan([decoding(a), decoding(b)], []), StepOutput(None, None, Picks(np.array([[7], [4], [0]]), None, None)), {})
    assert [t for t, _ in out[0].tokens] == [7] and out[0].finish is None and a.tokens[-1] == 7
    assert out[1].tokens == [] and out[1].finish == "stop"
