"""The graph cache in the engine: steady decoding reuses one graph (hit rate >= 95% over a
128-token decode); padding a batch to its bucket changes no sequence's tokens; fused and
unfused engines generate the same tokens; stats() reports the counters."""
import threading

import numpy as np
import pytest
from synth import FakeModel

from hearthlm.backends import get_backend
from hearthlm.runtime.engine import Engine
from hearthlm.runtime.graph_cache import bucket
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.sampling import SamplingParams


def generate(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    outs = [[] for _ in prompts]
    done = threading.Semaphore(0)
    reqs = [Request(prompt=list(p), params=SamplingParams(temperature=0.0), max_tokens=max_tokens, kind=Kind.GENERATE,
                    on_token=lambda t, lp, o=o: o.append(t), on_finish=lambda reason, err: done.release())
            for p, o in zip(prompts, outs)]
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=300)
    return outs


def engine(arch="llama", backend="reference", **kw) -> Engine:
    e = Engine(FakeModel(arch), get_backend(backend), n_ctx=256, kv_blocks=64, block_size=4, **kw)
    e.start()
    return e


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 64, 65, 130)] == [1, 2, 4, 8, 64, 128, 192]
    assert bucket(300, cap=256) == 300 and bucket(200, cap=256) == 256 and bucket(3, cap=3) == 3


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_steady_decode_hits(backend):
    e = engine(backend=backend)
    try:
        (toks,) = generate(e, [[1, 2, 3, 4, 5, 6, 7, 8]], 128)
        st = e.stats()
    finally:
        e.close()
    assert len(toks) == 128
    assert st["graph_cache_hits"] / (st["graph_cache_hits"] + st["graph_cache_misses"]) >= 0.95, st
    assert st["graph_nodes_fused"] < st["graph_nodes_unfused"]
    for k in ("graph_build_time_s", "graph_reuse_time_s", "graph_cache_hit_rate", "graph_arena_bytes"):
        assert k in st


def test_padding_is_harmless():
    """Three sequences together (3 tokens, padded to 4, three rows padded to 4) or alone."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    e = engine()
    try:
        together = generate(e, prompts, 12)
        alone = [generate(e, [p], 12)[0] for p in prompts]
    finally:
        e.close()
    assert together == alone


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_no_fusion_generates_the_same(arch):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    outs = []
    for fusion in (True, False):
        e = engine(arch, fusion=fusion)
        try:
            outs.append(generate(e, prompts, 10))
            assert e.stats()["graph_nodes_fused"] < e.stats()["graph_nodes_unfused"] or not fusion
        finally:
            e.close()
    assert outs[0] == outs[1]


def test_cache_off_builds_every_step():
    e = engine(graph_cache=False)
    try:
        generate(e, [[1, 2, 3]], 5)
        st = e.stats()
    finally:
        e.close()
    assert st["graph_cache_hits"] == 0 and st["graph_cache_misses"] == st["steps"]


def test_shapes_share_one_arena():
    """A long prompt grows the one arena after short ones were cached: the graphs cached before
    move to the new buffer and still decode the same (cpu: the backend that plans memory)."""
    prompts = [[1, 2, 3], [i % 49 + 1 for i in range(120)]]
    e = engine(backend="cpu")
    try:
        short = generate(e, prompts[:1], 8)  # the decode graph and a small prefill
        small = e.stats()["graph_cache_bytes"]
        generate(e, prompts[1:], 4)          # a larger prefill grows the arena
        st = e.stats()
        again = generate(e, prompts[:1], 8)  # the small graphs, rebound
        both = generate(e, prompts, 8)       # and mixed shapes
    finally:
        e.close()
    assert st["graph_cache_bytes"] > small > 0
    assert st["graph_cache_bytes"] == max(g.compiled.plan.arena_bytes for g in e.graphs._graphs.values())
    assert again == short and both[0] == short[0]
    buf = e.graphs.arena.buf  # no graph holds on to an old buffer
    outs = [o for g in e.graphs._graphs.values() for o in g.compiled.plan.outs if o is not None and o.size]
    assert outs and all(np.shares_memory(o, buf) for o in outs)
