"""Runs a graph on a backend. Passes, in order:
1. bind leaves: inputs from the step's feed, weights from the backend's prepared store,
   caches from the KV cache;
2. walk nodes in order, calling the backend's kernel for each;
3. drop each intermediate after its last consumer, so peak memory follows liveness.
Multi-backend splits and copies come with the GPU backend (issue 6)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from hearthlm.runtime.errors import BackendError
from hearthlm.runtime.graph import Graph, Op, Tensor
from hearthlm.runtime.weights import QWeight


class WeightStore:
    """Prepared (packed/uploaded) weights of one backend, made once on first use."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._prepared: dict[str, Any] = {}

    def get(self, w: QWeight) -> Any:
        p = self._prepared.get(w.name)
        if p is None:
            p = self._prepared[w.name] = self.backend.prepare_weight(w)
        return p

    def prepare_all(self, weights: Mapping[str, QWeight]) -> None:
        for w in weights.values():
            self.get(w)


def last_uses(graph: Graph) -> dict[int, list[Tensor]]:
    """node index -> the nodes whose last consumer is that node."""
    last: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.srcs:
            last[id(s)] = i
    for o in graph.outputs:
        last[id(o)] = len(graph.nodes)
    by_index: dict[int, list[Tensor]] = {}
    for node in graph.nodes:
        if node.op not in (Op.WEIGHT, Op.CACHE) and id(node) in last:
            by_index.setdefault(last[id(node)], []).append(node)
    return by_index


def execute(graph: Graph, store: WeightStore, feed: Mapping[str, Any],
            cache_of: Callable[[Tensor], Any]) -> list[Any]:
    backend = store.backend
    kernels = backend.kernels
    frees = last_uses(graph)
    values: dict[int, Any] = {}
    for i, node in enumerate(graph.nodes):
        op = node.op
        if op is Op.INPUT:
            v = backend.from_host(feed[node.name])
        elif op is Op.WEIGHT:
            v = store.get(node.params["weight"])
        elif op is Op.CACHE:
            v = cache_of(node)
        else:
            k = kernels.get(op)
            if k is None:
                raise BackendError(f"backend {backend.name!r} has no kernel for {op.value} ({node.label})")
            v = k(node, *[values[id(s)] for s in node.srcs])
        values[id(node)] = v
        for dead in frees.get(i, ()):
            values.pop(id(dead), None)
    return [backend.to_host(values[id(o)]) for o in graph.outputs]
