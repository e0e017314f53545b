"""The graph cache: the "semi-static graph". A graph is built, fused and planned once per
shape signature; a step whose signature `can_reuse` a cached graph only brings new inputs
(token ids, positions, KV slots, block tables, output rows), as llama.cpp's
`llm_graph_result::can_reuse`. Batch shapes are padded to a few buckets (`bucket`) so that
steady decoding keeps hitting the same graph."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from hearthlm.core.graph import Graph
from hearthlm.core.log import get_logger
from hearthlm.runtime import fusion, memory
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.dispatch import KERNEL, STATIC, VIEW, CompiledGraph, compile_graph
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.weights import WeightStore

log = get_logger("hearthlm.graph_cache")

FINE_UP_TO = 64  # token counts: powers of two up to here, then multiples of it (bounded padding)


def bucket(n: int, cap: int | None = None, *, step: int = FINE_UP_TO) -> int:
    """The padded size for n: 1, 2, 4, ... up to `step`, then multiples of `step` (FINE_UP_TO;
    an encoder's steps take 16, their inputs run whole and padding is all waste); at most
    `cap` (when n itself fits under it)."""
    b = 1 << max(n - 1, 0).bit_length() if n <= step else -(-n // step) * step
    return max(n, min(b, cap)) if cap else b


@dataclass(frozen=True)
class Signature:
    shape: BatchShape  # bucketed tokens, sequences, output rows; block-table width = the KV-length bucket
    placement: str     # the Placement's key: "cpu", or "cpu:0-14|cuda:15-29"
    fused: bool


@dataclass
class CachedGraph:
    sig: Signature
    compiled: CompiledGraph  # fused (if sig.fused), placed, planned and bound
    n_unfused: int      # nodes as built
    n_fused: int        # nodes after fusion (before placement adds copies and per-backend leaves)


def _rebind(cg: CompiledGraph, buf) -> None:
    """Point a compiled graph's planned buffers at `buf` (on a miss only: steps stay as fast)."""
    memory.bind(cg.plan, cg.graph.nodes, buf)
    for st in cg.steps:
        if st.kind is KERNEL and st.out is not None:
            st.out = cg.plan.outs[st.index]
        elif st.kind is VIEW:  # made again from the new buffer at the next run
            st.seen = st.view = None


def can_reuse(cached: CachedGraph, sig: Signature) -> bool:
    """Same shapes and placement: the graph's topology, buffers and arena fit; only the
    inputs differ."""
    return cached.sig == sig


class GraphCache:
    def __init__(self, build: Callable[[BatchShape], Graph], placement: Placement, *, fusion_on: bool | None = None,
                 enabled: bool = True, max_graphs: int = 16, weight_cache=None) -> None:
        self.build, self.placement = build, placement
        self.key = placement.key
        # each backend's prepared weights, shared by all the graphs compiled here; mapped from
        # `weight_cache` (a runtime.weight_cache.WeightCache) where it holds them
        self.stores = {name: WeightStore(b, weight_cache) for name, b in placement.backends.items()}
        self.arena = memory.Arena()  # the planned intermediates of every graph here: one at a time runs
        self.fused = fusion.enabled(fusion_on)
        self.enabled = enabled  # False: build every step (to measure what reuse saves)
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Signature, CachedGraph] = OrderedDict()
        self.counters = dict(graph_cache_hits=0, graph_cache_misses=0, graph_nodes_unfused=0,
                             graph_nodes_fused=0, graph_build_time_s=0.0, graph_build_last_ms=0.0,
                             graph_reuse_time_s=0.0, graph_arena_bytes=0, graph_no_reuse_bytes=0,
                             graph_splits=1, graph_copies=0)

    def get(self, shape: BatchShape) -> CompiledGraph:
        t0 = time.perf_counter()
        sig = Signature(shape, self.key, self.fused)
        hit = self._graphs.get(sig) if self.enabled else None
        if hit is not None and can_reuse(hit, sig):
            self._graphs.move_to_end(sig)
            self.counters["graph_cache_hits"] += 1
            self.counters["graph_reuse_time_s"] += time.perf_counter() - t0
            return hit.compiled
        entry = self._make(sig)
        if self.enabled:
            self._graphs[sig] = entry
            while len(self._graphs) > self.max_graphs:  # LRU: each holds an arena
                self._graphs.popitem(last=False)
        dt = time.perf_counter() - t0
        c = self.counters
        c["graph_cache_misses"] += 1
        c["graph_build_time_s"] += dt
        cg = entry.compiled
        c.update(graph_build_last_ms=dt * 1e3, graph_nodes_unfused=entry.n_unfused, graph_nodes_fused=entry.n_fused,
                 graph_arena_bytes=cg.plan.arena_bytes, graph_no_reuse_bytes=cg.plan.no_reuse_bytes,
                 graph_splits=cg.n_splits, graph_copies=cg.n_copies)
        log.debug("graph_cache_miss", shape=shape, fused=self.fused, nodes_unfused=entry.n_unfused,
                  nodes=entry.n_fused, arena_bytes=cg.plan.arena_bytes, ms=round(dt * 1e3, 2))
        return cg

    def forget(self, shapes: Callable[[BatchShape], bool], weights: Callable[[str], bool]) -> None:
        """Drop the cached graphs whose shape `shapes` picks and the prepared weights `weights` picks by
        name (an unloaded LoRA adapter's: its memory goes)."""
        for sig in [s for s in self._graphs if shapes(s.shape)]:
            del self._graphs[sig]
        for st in self.stores.values():
            st.forget(weights)

    def prepare(self, shape: BatchShape) -> None:
        """At load: compile the graph of `shape` (binding packs the weights it reads) and keep
        it, counting no miss: the first step of that shape then finds it ready."""
        sig = Signature(shape, self.key, self.fused)
        entry = self._make(sig)
        if self.enabled:
            self._graphs[sig] = entry

    def persist_weights(self) -> None:
        """Write the packed-weight cache where weights were prepared afresh; the graphs compiled
        so far then bind the weights mapped from it (the packed copies in memory go)."""
        changed = {name for name, st in self.stores.items() if st.persist()}
        for entry in self._graphs.values() if changed else ():
            cg = entry.compiled
            for st in cg.steps:
                if st.kind is STATIC and cg.backends[st.index] in changed:
                    st.value = self.stores[cg.backends[st.index]].get(st.node.params["weight"])
            cg.statics = cg.live = None  # walk's values list holds the old ones

    def _make(self, sig: Signature) -> CachedGraph:
        g = self.build(sig.shape)
        n_unfused = len(g.nodes)
        if sig.fused:  # before placement: a fused node is placed (and split around) as one
            g = fusion.fuse(g)
        buf = self.arena.buf
        cg = compile_graph(g, self.placement, self.stores, arena=self.arena)
        if self.arena.buf is not buf:  # it grew: the graphs bound to the old buffer move over
            for entry in self._graphs.values():
                _rebind(entry.compiled, self.arena.buf)
        return CachedGraph(sig, cg, n_unfused, len(g.nodes))

    def stats(self) -> dict[str, Any]:
        c = dict(self.counters)
        c["weight_cache"] = {name: st.cache_state for name, st in self.stores.items()}
        c["graph_cache_graphs"] = len(self._graphs)
        c["graph_cache_bytes"] = self.arena.buf.nbytes  # the one arena all cached graphs share
        n = c["graph_cache_hits"] + c["graph_cache_misses"]
        c["graph_cache_hit_rate"] = c["graph_cache_hits"] / n if n else 0.0
        return c
