"""Memory stays flat under mixed work: after open, one request of each size (a short prompt, a
long one, two at once) and a warm-up round of the mix, a second mixed round (short and long
prompts, cancels, timeouts, 1 to 24 at once, other shapes in another order) adds less than 20 MB of
RSS. New batch shapes enter the graph cache, but they share its one arena, sized for the largest
(stats' graph_cache_bytes).

The warm-up round is there because a first round's growth is one-off, not a leak: the graphs (up
to 16), their replay programs, the largest logits buffer, and glibc's malloc, which after freeing
a large block serves blocks up to its size from the heap and keeps them. A first round measured
22-33 MB on a fresh process and 33 MB in a full-suite run (stop 65's CI); the second round 3-9 MB,
and rounds after it ~1 MB each. Mutation seen to fail: replay keeping every step's outputs
(135 MB)."""
import asyncio
import random

from soak import KINDS, one, rss_mb

from hearthlm import Session

LONG = "The hearth " * 150  # ~300 tokens: a prefill chunk of the largest bucket this context takes


def touch_kv(s: Session) -> None:
    """The KV cache's pages are taken when first written and the block allocator cycles through
    all of them (least recently freed first): counted at its full size, fixed at open, from the
    start, the comparison is of everything else."""
    for a in [*s.engine.kv.k, *s.engine.kv.v]:
        a[...] = 0


async def mixed(s: Session, n: int, rng: random.Random) -> None:
    async def request(kind):
        if kind == "long":
            await s.generate(LONG + str(rng.random()), max_tokens=rng.randint(1, 8))
        else:
            await one(s, kind, rng)

    for _ in range(n // 12):  # bursts of 1 to 24 at once
        k = rng.choice([1, 2, 5, 12, 24])
        await asyncio.gather(*(request(rng.choice(KINDS + ["long"] * 3)) for _ in range(k)))


async def test_rss_flat_under_mixed_work(smollm2_path):
    async with Session.open(str(smollm2_path), n_ctx=512) as s:
        touch_kv(s)
        await s.generate("The capital of France is", max_tokens=8, temperature=0)
        await s.generate(LONG, max_tokens=8, temperature=0)
        await asyncio.gather(*(s.generate(p, max_tokens=8) for p in ("Once upon a time", "Water boils at")))
        await mixed(s, 120, random.Random(1))
        await asyncio.sleep(0.2)
        rss0, st0 = rss_mb(), s.stats()
        await mixed(s, 120, random.Random(0))
        await asyncio.sleep(0.2)
        rss1, st = rss_mb(), s.stats()
    print(f"RSS {rss0:.1f} -> {rss1:.1f} MB; graphs {st['graph_cache_graphs']}, arena {st['graph_cache_bytes']} bytes")
    assert st["graph_cache_misses"] > st0["graph_cache_misses"]  # new shapes did come
    # and (nearly) fit the arena the long prompt sized: one shared arena, not one per shape
    assert 0 < st0["graph_cache_bytes"] <= st["graph_cache_bytes"] < st0["graph_cache_bytes"] + (1 << 20)
    assert rss1 - rss0 < 20, (rss0, rss1, st["graph_cache_graphs"])
    assert st["kv_cache_bytes"] == sum(a.nbytes for a in [*s.engine.kv.k, *s.engine.kv.v]) > 0
