"""Runs a graph on a backend. Passes, in order:
0. plan, once per graph (runtime.memory; cached graphs carry theirs): liveness, and where
   the backend takes out= buffers, each intermediate's place in one arena;
1. bind leaves: inputs from the step's feed, weights from the backend's prepared store,
   caches from the KV cache;
2. walk nodes in order, calling the backend's kernel for each, `kernel(node, *srcs)` or,
   with a planned buffer, `kernel(node, *srcs, out=buffer)`;
3. drop each value after its last consumer (planned buffers stay in the arena).
Fusion ran before (runtime.fusion, when the graph was cached). Multi-backend splits and
copies come with the GPU backend (issue 6)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from hearthlm.runtime.errors import BackendError
from hearthlm.runtime.graph import Graph, Op, Tensor
from hearthlm.runtime.memory import ExecPlan, plan
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


def plan_for(graph: Graph, backend) -> ExecPlan:
    if graph.plan is None:
        graph.plan = plan(graph, arena=getattr(backend, "plans_memory", False))
    return graph.plan


def execute(graph: Graph, store: WeightStore, feed: Mapping[str, Any],
            cache_of: Callable[[Tensor], Any]) -> list[Any]:
    backend = store.backend
    kernels = backend.kernels
    p = plan_for(graph, backend)  # 0.
    values: dict[int, Any] = {}
    for i, node in enumerate(graph.nodes):
        op = node.op
        if op is Op.INPUT:  # 1.
            v = backend.from_host(feed[node.name])
        elif op is Op.WEIGHT:
            v = store.get(node.params["weight"])
        elif op is Op.CACHE:
            v = cache_of(node)
        else:  # 2.
            k = kernels.get(op)
            if k is None:
                raise BackendError(f"backend {backend.name!r} has no kernel for {op.value} ({node.label})")
            out = p.outs[i]
            srcs = [values[id(s)] for s in node.srcs]
            v = k(node, *srcs) if out is None else k(node, *srcs, out=out)
        values[id(node)] = v
        for dead in p.frees[i]:  # 3.
            values.pop(id(dead), None)
    return [backend.to_host(values[id(o)]) for o in graph.outputs]
