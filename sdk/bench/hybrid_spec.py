"""Speculative decoding on a hybrid model at Qwen3.5-0.8B's shapes (random weights, the bench's
cached qwen35 writer): decode tokens/s of plain decoding against n-gram speculation, in rounds
taken in turn (medians), one process. Random weights do not copy their input, so three kinds of
drafts are timed: `ngram` as is on a self-repeating prompt (what acceptance it gets), and the
n-gram drafter fed the plain run's own continuation, every draft right (`all`, acceptance 1) or
one token of each draft wrong at a spot that moves (`part`): the cost of verification rows and
state rollback at a known acceptance. Acceptance on random weights says nothing about real text.

    python -m hearthlm.bench.hybrid_spec [--tokens 64] [--rounds 3] [--backend cpu]"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import anyio

from hearthlm.bench.vision_qwen import cached_qwen35_pair
from hearthlm.runtime import speculative
from hearthlm.session import Session

MODES = ("plain", "ngram", "all", "part")


def _prompt(n: int = 96) -> list[int]:
    """A self-repeating prompt: 24 byte tokens four times over."""
    return [1000 + (i * 37) % 24 * 101 for i in range(n)]


class _Fed:
    """Drafts from a known continuation (the plain run's), all right or one wrong in each."""

    def __init__(self, full: list[int], wrong: bool) -> None:
        self.full, self.wrong = full, wrong

    def __call__(self, drafter, tokens, limit):
        limit = min(drafter.k, limit)
        d = list(self.full[len(tokens):len(tokens) + max(limit, 0)])
        j = len(tokens) % 4
        if self.wrong and j < min(len(d), 3):
            d[j] = (d[j] + 1) % 200 + 3
        return d


async def _one(s: Session, prompt: list[int], n: int, mode: str, full: list[int] | None) -> tuple[float, int, int, list[int]]:
    """(decode tokens/s after the first token, drafted, accepted, tokens) of one request."""
    real = speculative.NgramDrafter.propose
    if mode in ("all", "part"):
        fed = _Fed(full, mode == "part")
        speculative.NgramDrafter.propose = lambda self, tokens, limit: fed(self, tokens, limit)
    try:
        before = s.stats()
        times, toks = [], []
        async for c in s.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True,
                                speculative=None if mode == "plain" else "ngram"):
            if c.token_ids:
                times.append(time.perf_counter())
                toks.extend(c.token_ids)
        st = s.stats()
    finally:
        speculative.NgramDrafter.propose = real
    rate = (len(toks) - 1) / (times[-1] - times[0])
    return (rate, st["spec_drafted_tokens"] - before["spec_drafted_tokens"],
            st["spec_accepted_tokens"] - before["spec_accepted_tokens"], toks)


async def main(tokens: int, rounds: int, backend: str) -> None:
    path = cached_qwen35_pair()[0]
    prompt = _prompt()
    async with Session.open(str(path), n_ctx=1024, backend=backend) as s:
        ref = (await _one(s, prompt, tokens, "plain", None))[3]  # the continuation
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        counts: dict[str, list[int]] = {m: [0, 0] for m in MODES}
        for m in MODES:  # warm-up: each mode's step shapes compiled, the threads tuned
            await _one(s, prompt, tokens, m, prompt + ref)
        for _ in range(rounds):
            for m in MODES:
                rate, drafted, kept, toks = await _one(s, prompt, tokens, m, prompt + ref)
                assert toks == ref, f"{m}: the tokens differ from plain decoding's"
                rates[m].append(rate)
                counts[m][0] += drafted
                counts[m][1] += kept
    load = os.getloadavg()[0]
    base = statistics.median(rates["plain"])
    print(f"qwen35 at 0.8B shapes (random weights), {backend}, {tokens} tokens, {rounds} rounds, load {load:.1f}")
    for m in MODES:
        r = statistics.median(rates[m])
        acc = counts[m][1] / counts[m][0] if counts[m][0] else float("nan")
        print(f"  {m:<6} {r:7.2f} tok/s  x{r / base:4.2f}  drafted {counts[m][0]:4d}  acceptance {acc:.2f}")
    print("  (identical tokens in every run; acceptance on random weights says nothing about real text)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args()
    anyio.run(main, a.tokens, a.rounds, a.backend)
