"""Soak: many mixed requests at once on a real model, and afterwards nothing left over.

Mix (of N requests at concurrency C): 40% normal, 20% cancelled at a random moment, 15%
with a tiny timeout, 10% with stop strings, 10% with invalid arguments, 5% longer than the
context. Every request must end in a result or a HearthError, none may hang; afterwards KV
blocks in use, running requests and queue depth are 0, RSS has grown less than 30 MB over
the run (after a warm-up round of the same mix), and five greedy prompts give the outputs
they gave before. `make soak` runs 600 at 24; the test suite a shorter round.

    python tests/soak.py [--requests 600] [--concurrency 24] [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import resource
import time
from collections import Counter

from hearthlm import HearthError, Session

GREEDY = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
          "The three primary colors are"]
KINDS = ["normal"] * 8 + ["cancel"] * 4 + ["timeout"] * 3 + ["stop"] * 2 + ["invalid"] * 2 + ["too_long"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def greedy(s: Session) -> list[list[int]]:
    return [(await s.generate(p, max_tokens=12, temperature=0)).token_ids for p in GREEDY]


async def one(s: Session, kind: str, rng: random.Random) -> str:
    """The request's outcome: "ok", "cancelled" or the HearthError's class name."""
    prompt = f"Request {rng.randrange(10**6)}: tell me about " + rng.choice(["rivers", "bread", "stars", "clocks"])
    kw = dict(max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
    if kind == "stop":
        kw["stop"] = [" the", ".", "\n"]
    elif kind == "timeout":
        kw["timeout"] = rng.choice([0.0, 0.001, 0.01])
    elif kind == "invalid":
        kw.update(rng.choice([dict(top_p=0.0), dict(max_tokens=0), dict(temperature=-1), dict(stop=[""]),
                              dict(top_logprobs=99), dict(top_k="3")]))
    elif kind == "too_long":
        prompt = "hearth " * (s.n_ctx + 10)
    try:
        if kind == "cancel":
            task = asyncio.ensure_future(s.generate(prompt, **kw))
            await asyncio.sleep(rng.uniform(0, 0.3))
            task.cancel()
            try:
                await task
                return "ok"
            except asyncio.CancelledError:
                return "cancelled"
        await s.generate(prompt, **kw)
        return "ok"
    except HearthError as e:
        return type(e).__name__


async def round_of(s: Session, n: int, concurrency: int, rng: random.Random) -> Counter:
    sem = asyncio.Semaphore(concurrency)
    outcomes: Counter = Counter()

    async def guarded(kind):
        async with sem:
            outcomes[(kind, await one(s, kind, rng))] += 1
    await asyncio.wait_for(asyncio.gather(*(guarded(rng.choice(KINDS)) for _ in range(n))), timeout=60 + n)
    return outcomes


async def soak(model: str, n: int, concurrency: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    async with Session.open(model, n_ctx=512) as s:
        before = await greedy(s)
        await round_of(s, max(n // 4, 100), concurrency, rng)  # warm-up: batch shapes, allocator pools
        await asyncio.sleep(0.2)
        rss0, t0 = rss_mb(), time.perf_counter()
        outcomes = await round_of(s, n, concurrency, rng)
        took = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # aborted requests leave the engine at its next step
        st = s.stats()
        after = await greedy(s)
        return dict(requests=n, concurrency=concurrency, seconds=round(took, 1), outcomes=dict(outcomes),
                    kv_blocks_used=st["kv_blocks_used"], running=st["running_requests"],
                    queue_depth=st["queue_depth"], rss_growth_mb=round(rss_mb() - rss0, 1),
                    greedy_same=before == after, healthy=s.health()["ok"])


def check(r: dict) -> list[str]:
    """What is wrong with a soak's result (empty: it passed)."""
    bad = [f"{k} = {r[k]}" for k in ("kv_blocks_used", "running", "queue_depth") if r[k]]
    if r["rss_growth_mb"] >= 30:
        bad.append(f"RSS grew {r['rss_growth_mb']} MB")
    if not r["greedy_same"]:
        bad.append("greedy outputs changed")
    if not r["healthy"]:
        bad.append("engine unhealthy")
    if sum(r["outcomes"].values()) != r["requests"]:
        bad.append("requests missing")
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    result = asyncio.run(soak(a.model, a.requests, a.concurrency))
    for k, v in result.items():
        print(f"{k}: {v}")
    problems = check(result)
    print("soak:", "passed" if not problems else "FAILED: " + "; ".join(problems))
    raise SystemExit(1 if problems else 0)
