"""Sampling behaviour against numpy references on fixed logits: the candidate sets of top-k,
top-p and min-p (and the frequencies inside them), the penalties' effect on the logits as
llama.cpp applies them, temperature 0 as argmax, and seeded reproducibility."""
from collections import Counter

import numpy as np
import pytest

from hearthlm.runtime.sampling import SamplingParams, apply_penalties, sample

V = 64
LOGITS = (np.random.default_rng(0).standard_normal(V) * 2.0).astype(np.float32)  # distinct values
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every filter off


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_dist(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> dict[int, float]:
    """The distribution sampling should draw from, as vLLM / HF order it: temperature, then
    top-k, then top-p and min-p on the renormalized top-k probabilities."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if top_k:
        order = order[:top_k]
    p = softmax(np.array([logits[i] for i in order], np.float64) / temperature)
    keep, mass = [], 0.0
    for i, pi in zip(order, p):  # the smallest most-likely prefix whose mass reaches top_p
        if mass >= top_p:
            break
        keep.append((i, pi))
        mass += pi
    keep = [(i, pi) for i, pi in keep if pi >= min_p * p[0]]
    total = sum(pi for _, pi in keep)
    return {i: pi / total for i, pi in keep}


def draws(params: SamplingParams, n: int, seed: int = 1, logits=LOGITS) -> list[int]:
    rng = np.random.default_rng(seed)
    return [sample(logits, params, rng, []) for _ in range(n)]


CASES = [
    pytest.param(dict(temperature=1.0, **{**OFF, "top_k": 5}), id="top_k=5"),
    pytest.param(dict(temperature=0.7, **{**OFF, "top_k": 12}), id="top_k=12,T=0.7"),
    pytest.param(dict(temperature=1.0, **{**OFF, "top_p": 0.6}), id="top_p=0.6"),
    pytest.param(dict(temperature=1.5, **{**OFF, "top_p": 0.9}), id="top_p=0.9,T=1.5"),
    pytest.param(dict(temperature=1.0, **{**OFF, "min_p": 0.1}), id="min_p=0.1"),
    pytest.param(dict(temperature=2.0, **{**OFF, "min_p": 0.3}), id="min_p=0.3,T=2"),
    pytest.param(dict(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05), id="all three"),
    pytest.param(dict(temperature=0.8, **OFF), id="no filter,T=0.8"),
]


@pytest.mark.parametrize("kw", CASES)
def test_candidate_set_and_frequencies(kw):
    ref = reference_dist(LOGITS, **kw)
    filtered = any(kw[k] != v for k, v in OFF.items())
    assert 2 <= len(ref) < V if filtered else len(ref) == V  # a filter leaves some, not all
    n = 6000
    counts = Counter(draws(SamplingParams(**kw), n))
    assert set(counts) <= set(ref), f"sampled outside the candidate set: {set(counts) - set(ref)}"
    reachable = {i for i, p in ref.items() if p * n >= 20}  # sure to be drawn (not a flaky rare one)
    assert reachable <= set(counts), f"never sampled: {reachable - set(counts)}"
    for i, p in ref.items():  # and in the right proportions (5 sigma)
        assert abs(counts[i] / n - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (i, counts[i] / n, p)


def test_top_k_one_and_temperature_zero_are_argmax():
    rng = np.random.default_rng(2)
    for _ in range(50):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        want = int(np.argmax(logits))
        assert sample(logits, SamplingParams(temperature=0.0), rng, []) == want
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1), rng, []) == want


def test_tiny_temperature_is_argmax_not_an_error():
    # logits / 1e-310 overflow to inf (and inf - inf is NaN) unless the max is taken off first
    assert draws(SamplingParams(temperature=1e-310, **OFF), 5) == [int(np.argmax(LOGITS))] * 5


def reference_penalties(logits, history, rep, freq, pres):
    """llama.cpp's penalties sampler: a seen token's logit divided by `rep` when positive,
    multiplied when not, then less count * freq + pres."""
    out = logits.astype(np.float64)
    for tok, count in Counter(history).items():
        if tok >= len(logits):
            continue
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
        out[tok] -= count * freq + pres
    return out


HISTORY = [int(np.argmax(LOGITS)), int(np.argmin(LOGITS)), 3, 3, 3, 7, 7, V + 5]  # V + 5: outside the vocab


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7), (1.5, 0.25, 0.5),
                                           (0.8, -0.3, 0.0)])
def test_penalties(rep, freq, pres):
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    got = apply_penalties(LOGITS, p, HISTORY)
    want = reference_penalties(LOGITS, HISTORY, rep, freq, pres)
    seen = np.zeros(V, bool)
    seen[[t for t in HISTORY if t < V]] = True
    assert np.array_equal(got[~seen], LOGITS[~seen])  # tokens never seen are untouched
    # the code rounds the divided logit to float32 before subtracting: an ulp or so apart
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-6, atol=1e-6)
    assert np.any(got[seen] != LOGITS[seen])
    assert LOGITS.tolist() == apply_penalties(LOGITS, p, []).tolist()  # no history, no change


def test_token_counts_kept_as_tokens_come():
    """The request's counts grow with each generated token (past the first array size) and
    give what counting the whole history gives."""
    from hearthlm.runtime.request import Kind, Request
    rng = np.random.default_rng(3)
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
    r = Request(prompt=HISTORY, params=p, max_tokens=64, on_token=None, on_finish=None, kind=Kind.GENERATE)
    for t in rng.integers(0, V, 50):
        r.append(int(t))
    ids, counts = np.unique(r.tokens, return_counts=True)
    n = len(r.counts)
    assert n == len(ids) > 16
    assert dict(zip(r.counts.ids[:n].tolist(), r.counts.counts[:n].tolist())) == dict(zip(ids.tolist(), counts.tolist()))
    assert np.array_equal(apply_penalties(LOGITS, p, r.counts), apply_penalties(LOGITS, p, r.tokens))
    assert Request(prompt=[1, 2], params=SamplingParams(), max_tokens=1, on_token=None, on_finish=None,
                   kind=Kind.GENERATE).counts is None


def test_penalties_steer_the_greedy_choice():
    top = int(np.argmax(LOGITS))
    p = SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=100.0)
    want = int(np.argmax(reference_penalties(LOGITS, [top], 1.0, 0.0, 100.0)))
    assert want != top and sample(LOGITS, p, np.random.default_rng(0), [top]) == want
    assert sample(LOGITS, p, np.random.default_rng(0), []) == top


def test_seeded_reproducibility():
    p = SamplingParams(temperature=1.0, **OFF)
    a, b, c = draws(p, 200, seed=5), draws(p, 200, seed=5), draws(p, 200, seed=6)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # a wide distribution, so the comparison above means something


def test_top_k_ids_are_the_k_largest_in_id_order():
    """top_k_ids over vocabulary-sized rows (a few -inf, many equal values, a NaN row that
    takes the plain partition) gives the values of np.argpartition's k, ids ascending; among
    entries equal to the k-th largest, the lowest ids. Mutations: the final np.sort dropped
    fails it (ties come after the larger entries); so does taking the highest-id ties."""
    from hearthlm.runtime.sampling import top_k_ids
    rng = np.random.default_rng(5)
    for trial in range(40):
        n, k = int(rng.choice([1000, 49152, 151936])), int(rng.choice([1, 5, 40, 200]))
        x = (rng.standard_normal(n) * rng.uniform(0.3, 8)).astype(np.float32)
        if trial % 4 == 0:
            x[rng.integers(0, n, 50)] = -np.inf
        if trial % 5 == 0:
            x = np.round(x)  # many equal values: the set is then compared by value
        if trial == 7:
            x[::3] = np.nan
        ids = top_k_ids(x, k)
        assert len(ids) == k and np.all(np.diff(ids) > 0)
        if trial == 7:
            continue
        assert np.array_equal(np.sort(x[ids]), np.sort(x[np.argpartition(-x, k - 1)[:k]]))
    x = np.zeros(49152, np.float32)
    x[[7, 30000, 40000]] = 1.0
    assert top_k_ids(x, 40).tolist() == sorted([7, 30000, 40000] + [i for i in range(39) if i != 7][:37])


def _numpy_sample(cand, values, p, rng) -> int:
    """The candidates' truncation in numpy arrays and numpy's own weighted choice: what
    sample_top_k computed before its small rows moved to Python floats (runtime.sampling.SMALL)."""
    z = (values.astype(np.float64) - np.float64(values.max())) / p.temperature
    order = np.argsort(-z, kind="stable")
    cand, z = cand[order], z[order]
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    keep = np.ones(len(cand), bool)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    if p.top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < p.top_p
    keep[0] = True
    probs = probs[keep] / probs[keep].sum()
    return int(cand[keep][rng.choice(len(probs), p=probs)])


def test_candidates_sample_as_numpy_arrays_and_choice_do():
    """sample_top_k over 1-100 candidates (both sides of SMALL), ties and -inf among them: the
    token numpy's arrays and Generator.choice draw, and one random() taken from the generator.
    Mutations seen to fail: _draw searching 1 - random() (the draw's direction); the top_p test
    on the mass up to and including a candidate; min_p kept strictly above its floor; ties
    sorted highest id first. (bisect_left for choice's side='right' differs only where random()
    equals a cumulative sum exactly: no trial reaches that.)"""
    from hearthlm.runtime.sampling import sample_top_k
    g = np.random.default_rng(11)
    for trial in range(6000):
        k = int(g.integers(1, 101))
        v = (g.standard_normal(k) * g.choice([0.5, 3.0, 20.0])).astype(np.float32)
        if trial % 4 == 0:
            v = np.round(v)  # ties
        if trial % 7 == 0 and k > 1:
            v[g.integers(0, k)] = -np.inf
        cand = np.sort(g.choice(50000, k, replace=False))
        p = SamplingParams(temperature=float(g.choice([0.3, 0.8, 1.5])), top_k=k,
                           top_p=float(g.choice([0.3, 0.95, 1.0])), min_p=float(g.choice([0.0, 0.05, 0.5, 1.0])))
        a, b = np.random.default_rng(trial), np.random.default_rng(trial)
        assert sample_top_k(cand, v, True, p, a) == _numpy_sample(cand, v, p, b), trial
        assert a.random() == b.random(), trial
