"""Per-request sampling over the logits of output rows. Greedy when temperature is 0."""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.errors import InvalidRequestError

SPECULATIVE = (None, "ngram", "draft", "mtp", "off")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40                 # 0: off
    top_p: float = 0.95             # 1.0: off
    min_p: float = 0.05             # 0.0: off
    repetition_penalty: float = 1.0  # >1 discourages tokens already seen (prompt and output)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0           # report the k most likely tokens per step
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False        # keep going past end-of-generation tokens (benchmarks)
    min_tokens: int = 0             # no end-of-generation, stop token or stop string before this many
    # added to the logits before anything else (OpenAI's logit_bias); -inf bans a token
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # "ngram": prompt-lookup drafts verified in one forward pass (runtime.speculative); "draft": the
    # session's draft model's (runtime.draft); "mtp": the model's own multi-token-prediction block's
    # (runtime.draft_heads); None: the draft model where the session has one; "off"
    speculative: str | None = None

    def __post_init__(self) -> None:
        def number(name, v):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise InvalidRequestError(f"{name} must be a number, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            number(name, getattr(self, name))
        for name in ("top_k", "top_logprobs") + (("seed",) if self.seed is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidRequestError(f"{name} must be an int, got {v!r}")
        ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, (int, np.integer)) else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias
                                if not isinstance(t, bool) and isinstance(t, (int, np.integer))
                                and not isinstance(b, bool) and isinstance(b, (int, float))))
        except (TypeError, ValueError):
            bias = None
        if bias is None or len(bias) != len(self.logit_bias) or any(t < 0 or math.isnan(b) or b == math.inf
                                                                     for t, b in bias):
            raise InvalidRequestError(f"logit_bias must map token ids (ints >= 0) to numbers (or -inf), "
                                      f"got {self.logit_bias!r}"[:300])
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, (int, np.integer)) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.speculative not in SPECULATIVE:
            raise InvalidRequestError(f"speculative must be one of {', '.join(map(str, SPECULATIVE))}, "
                                      f"got {self.speculative!r}"[:300])
        checks = [
            (math.isfinite(self.temperature), "temperature must be finite"),
            (self.seed is None or self.seed >= 0, "seed must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def steer(logits: np.ndarray, p: SamplingParams, n_generated: int, eog) -> np.ndarray:
    """The logits as the request's own rules shape them before sampling: its logit_bias, and
    before min_tokens no end-of-generation or stop token (a copy only where one applies)."""
    early = n_generated < p.min_tokens
    if not p.logit_bias and not early:
        return logits
    logits = logits.astype(np.float32).copy()
    n = logits.shape[0]
    for t, b in p.logit_bias:
        if t < n:
            logits[t] += b
    if early:
        ban = [t for t in (*eog, *p.stop_token_ids) if 0 <= t < n]
        logits[ban] = -np.inf
    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


LSE_ROWS = 8  # rows a block: 16 MB of float64 at a 262K vocabulary, reused


def logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """Each row's log(sum(exp)) of (n, n_vocab), in float64: the terms log_softmax subtracts, with
    its arithmetic (the same bits). A few rows at a time in one buffer: the whole (n, n_vocab) in
    float64, and its temporaries, were 4 GB for a 512-token chunk of Gemma 3 (262K vocabulary):
    17-33 s a chunk on a 2-core VM, where these 512 rows take 0.34 s."""
    n = x.shape[0]
    out = np.empty(n, np.float64)
    buf = np.empty((min(n, LSE_ROWS), x.shape[1]), np.float64)
    for i in range(0, n, LSE_ROWS):
        b = buf[:min(LSE_ROWS, n - i)]
        np.copyto(b, x[i:i + len(b)])
        m = b.max(axis=1, keepdims=True)
        np.subtract(b, m, out=b)
        np.exp(b, out=b)
        out[i:i + len(b)] = m[:, 0] + np.log(b.sum(axis=1))
    return out


def top_logprobs(logits: np.ndarray, k: int, sampled: int | None = None) -> list[tuple[int, float]]:
    """The k most likely (id, logprob), then `sampled` when it is not among them (its logprob is
    what OpenAI's `logprobs` reports, sampled or not)."""
    lp = log_softmax(logits)
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = [int(i) for i in idx[np.argsort(-lp[idx], kind="stable")]]
    if sampled is not None and sampled not in idx:
        idx.append(sampled)
    return [(i, float(lp[i])) for i in idx]


class TokenCounts:
    """How often each token occurred in a request's tokens, kept as they come (the penalties
    read it every step: counting the whole history each time was quadratic in its length).
    ids[:n] in first-seen order, counts[:n] beside them."""

    def __init__(self, tokens=()) -> None:
        self.index: dict[int, int] = {}
        self.ids = np.empty(16, np.int64)
        self.counts = np.zeros(16, np.int64)
        for t in tokens:
            self.add(t)

    def add(self, t: int) -> None:
        i = self.index.get(t)
        if i is None:
            i = self.index[t] = len(self.index)
            if i == len(self.ids):
                self.ids, self.counts = (np.concatenate([a, np.zeros_like(a)]) for a in (self.ids, self.counts))
            self.ids[i] = t
        self.counts[i] += 1

    def __len__(self) -> int:
        return len(self.index)


def penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(logits: np.ndarray, p: SamplingParams, history) -> np.ndarray:
    """history: a TokenCounts, or the tokens themselves."""
    if not len(history) or not penalized(p):
        return logits
    if not isinstance(history, TokenCounts):
        history = TokenCounts(history)
    logits = logits.astype(np.float32).copy()
    n = len(history)
    ids, counts = history.ids[:n], history.counts[:n]
    ids_ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ids_ok], counts[ids_ok]
    if p.repetition_penalty != 1.0:  # as llama.cpp / HF: shrink positive logits, grow negative ones
        v = logits[ids]
        logits[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
    return logits


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of x's k largest entries (0 < k < len(x)), ascending; among entries equal to the
    k-th largest, the lowest ids. np.argpartition over a vocabulary costs ~0.6 ms a row: here a
    strided sample's k-th largest is a threshold that at least k entries reach, and the k-th
    largest of those few hundred is x's (~35 us a row)."""
    step = x.shape[0] // (64 * k)
    sub = np.arange(x.shape[0])
    if step >= 2:
        sample = x[::step]
        reach = np.flatnonzero(x >= np.partition(sample, len(sample) - k)[len(sample) - k])
        sub = reach if len(reach) >= k else sub  # not so where a NaN is the threshold
    vals = x[sub]
    kth = np.partition(vals, len(vals) - k)[len(vals) - k]
    above = sub[vals > kth]
    ids = np.sort(np.concatenate([above, sub[vals == kth][:k - len(above)]]))
    return ids if len(ids) == k else np.sort(np.argpartition(-x, k - 1)[:k])  # NaNs: as the partition has them


def distribution(logits: np.ndarray, p: SamplingParams, history) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their probabilities) that sampling draws from: temperature, top_k, min_p
    and top_p applied to the penalized logits. Not for greedy parameters."""
    logits = apply_penalties(logits, p, history)
    n = logits.shape[0]
    # ids ascending, so that equal logits go lowest id first; top_k before the float64 arithmetic,
    # which is monotone in the logits and so keeps the same candidates, on k of them only
    cand = top_k_ids(logits, p.top_k) if p.top_k and p.top_k < n else np.arange(n)
    return truncated(cand, logits[cand], logits.max(), p)


def truncated(cand: np.ndarray, values: np.ndarray, vmax, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """distribution() from its candidates (ids ascending), their logits and the row's max:
    temperature, min_p and top_p."""
    if len(cand) <= SMALL:
        ids, probs = _truncated_small(cand.tolist(), values.tolist(), float(vmax), p)
        return np.array(ids, cand.dtype), np.array(probs)
    # the max comes off before dividing: logits / 1e-310 would overflow to inf (inf - inf: NaN)
    z = values.astype(np.float64)
    with np.errstate(over="ignore"):  # far below the max: -inf, a probability of 0
        z = (z - np.float64(vmax)) / p.temperature
    order = np.argsort(-z, kind="stable")  # descending
    cand, z = cand[order], z[order]
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    keep = np.ones(len(cand), bool)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    if p.top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < p.top_p  # smallest prefix reaching top_p
    keep[0] = True
    return cand[keep], probs[keep] / probs[keep].sum()


# Up to this many candidates (top_k's usual 20-64) truncated() works on Python floats: ~15 us a
# row where numpy's per-call overhead made it ~60 (and choice() ~28), per row and step of every
# sampled generation. The same steps in float64; sums run in order where numpy's sum pairs them,
# which may differ in the last bit: sample() and sample_top_k both come here for the same k.
SMALL = 64


def _truncated_small(cand: list, values: list, vmax: float, p: SamplingParams) -> tuple[list, list]:
    t = p.temperature
    z = [(v - vmax) / t for v in values]  # past float64's range: -inf (Python floats do not raise)
    if any(v != v for v in z):  # a NaN logit, or an infinite max: numpy's choice() refuses them so
        raise ValueError("Probabilities contain NaN")
    order = sorted(range(len(z)), key=z.__getitem__, reverse=True)  # descending, ties by id (stable)
    z0 = z[order[0]]
    probs = [math.exp(z[i] - z0) for i in order]
    s = math.fsum(probs)
    probs = [q / s for q in probs]
    floor = p.min_p * probs[0] if p.min_p > 0.0 else -1.0
    ids, kept, before = [], [], 0.0
    for j, (i, q) in enumerate(zip(order, probs)):
        if j == 0 or q >= floor and (p.top_p >= 1.0 or before < p.top_p):  # before: the mass ahead of it
            ids.append(cand[i])
            kept.append(q)
        before += q
    s = math.fsum(kept)
    return ids, [q / s for q in kept]


def _draw(probs, rng: np.random.Generator) -> int:
    """rng.choice(len(probs), p=probs) without its checks (probs are normalized): the same index
    and the same use of the generator (one random()), a fifth of the time."""
    cdf = list(itertools.accumulate(probs))
    last = cdf[-1]
    if last != last:
        raise ValueError("Probabilities contain NaN")
    return bisect.bisect_right([c / last for c in cdf], rng.random())


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history) -> int:
    """logits (n_vocab,) float32 -> token id; history: what apply_penalties takes."""
    if p.greedy:
        return int(np.argmax(apply_penalties(logits, p, history)))
    cand, probs = distribution(logits, p, history)
    return int(cand[_draw(probs.tolist(), rng)])


def sample_top_k(cand: np.ndarray, values: np.ndarray, ok: bool, p: SamplingParams, rng: np.random.Generator) -> int:
    """sample() of a row without penalties whose top_k candidates (top_k_ids's, ascending) and
    their logits were taken where the logits are (Backend.top_k_rows): the same token for the
    same rng. ok False: the row had a NaN, which sample() fails on too."""
    if not ok:
        raise ValueError("Probabilities contain NaN")
    if len(cand) <= SMALL:
        vs = values.tolist()
        ids, probs = _truncated_small(cand.tolist(), vs, max(vs), p)
        return int(ids[_draw(probs, rng)])
    cand, probs = truncated(cand, values, values.max(), p)
    return int(cand[_draw(probs.tolist(), rng)])


def verify(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history, draft: int) -> tuple[int, bool]:
    """Speculative sampling of one position whose draft token came from a point-mass draft
    (prompt lookup): (the token, whether it is the draft). The draft is kept with the target's
    probability of it, else a token is drawn from the target with the draft taken out, so the
    output follows the target distribution exactly (Leviathan et al.; llama.cpp and vLLM's
    rejection sampler with q = one-hot). Greedy: kept where it is the argmax."""
    if p.greedy:
        tok = int(np.argmax(apply_penalties(logits, p, history)))
        return tok, tok == draft
    cand, probs = distribution(logits, p, history)
    at = np.flatnonzero(cand == draft)
    pd = float(probs[at[0]]) if len(at) else 0.0
    if pd > 0.0 and rng.random() < pd:
        return draft, True
    if len(at):
        if pd >= 1.0:  # only rounding can land here: nothing else has mass
            return draft, True
        probs = probs.copy()
        probs[at[0]] = 0.0
        probs /= probs.sum()
    return int(cand[_draw(probs.tolist(), rng)]), False
