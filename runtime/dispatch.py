"""Runs a graph on its backends. Passes, in order:
0. plan, once per graph (runtime.memory; cached graphs carry theirs): liveness, and where
   a backend takes out= buffers, its intermediates' places in one host arena (a placed
   graph: the nodes of such backends; the others, and COPY nodes, allocate their own);
1. bind leaves: inputs from the step's feed (each backend uploads its own), weights from
   the node's backend's prepared store, caches from the KV cache;
2. walk nodes in order, calling the node's backend's kernel, `kernel(node, *srcs)` or,
   with a planned buffer, `kernel(node, *srcs, out=buffer)`; a COPY moves its source to
   its backend (`copy`);
3. drop each value after its last consumer (planned buffers stay in the arena).
Fusion ran before (runtime.fusion), then placement (runtime.placement: which backend runs
each node, the split into runs, the COPY nodes), when the graph was cached."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from hearthlm.runtime.errors import BackendError
from hearthlm.runtime.graph import Graph, Op, Tensor
from hearthlm.runtime.memory import VIEWS, ExecPlan, plan
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


def plan_for(graph: Graph, backend) -> ExecPlan:
    """`backend`: the one backend, or {name: backend} of a placed graph (graph.backends)."""
    if graph.plan is None:
        if graph.backends is None:
            graph.plan = plan(graph, arena=getattr(backend, "plans_memory", False))
        else:  # one host arena, shared by the nodes of the backends that take out= buffers
            own = [getattr(backend[b], "plans_memory", False) and n.op is not Op.COPY
                   for n, b in zip(graph.nodes, graph.backends)]
            p = plan(graph, arena=any(own))
            p.outs = [o if mine else None for o, mine in zip(p.outs, own)]
            graph.plan = p
    return graph.plan


def copy(src, dst, value: Any) -> Any:
    """`value` of backend `src` on backend `dst`: the destination's own copy where it has one
    (the CUDA backend's: async, on its copy stream, through pinned host buffers), else a
    round trip through host memory."""
    copy_from = getattr(dst, "copy_from", None)
    if copy_from is not None:
        return copy_from(src, value)
    v = dst.from_host(src.to_host(value))
    return v.copy() if v is value else v  # host to host: the source's buffer goes back to the arena


_INPUT, _STATIC, _CACHE, _COPY, _KERNEL, _VIEW = range(6)


def compile_program(graph: Graph, store) -> list[tuple]:
    """The graph as a flat list of steps (node index, kind, callable or value, node, source
    indices, out buffer, indices to free): the per-node work of passes 1-3 resolved once per
    graph, so a cached graph's step costs a tuple unpack and a call per node."""
    placed = graph.backends is not None
    stores = store if placed else {None: store}
    names = graph.backends if placed else [None] * len(graph.nodes)
    p = plan_for(graph, {k: s.backend for k, s in stores.items()} if placed else store.backend)  # 0.
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    prog = []
    planned: set[int] = set()  # nodes whose value is an arena buffer or a view of one
    for i, node in enumerate(graph.nodes):
        st = stores[names[i]]
        backend, op = st.backend, node.op
        srcs = tuple(index[id(s)] for s in node.srcs)
        frees = tuple(index[id(d)] for d in p.frees[i])
        if op is Op.INPUT:  # 1.
            prog.append((i, _INPUT, backend.from_host, node, srcs, None, frees))
        elif op is Op.WEIGHT:
            prog.append((i, _STATIC, st.get(node.params["weight"]), node, srcs, None, frees))
        elif op is Op.CACHE:
            prog.append((i, _CACHE, None, node, srcs, None, frees))
        elif op is Op.COPY:  # 2.
            prog.append((i, _COPY, (stores[node.params["src"]].backend, backend), node, srcs, None, frees))
        else:
            k = backend.kernels.get(op)
            if k is None:
                raise BackendError(f"backend {backend.name!r} has no kernel for {op.value} ({node.label})")
            if op in VIEWS and srcs[0] in planned:
                # a view of an arena buffer: made once and reused while the source's value is the
                # same object (kernels that return their out= buffer make it so every step)
                planned.add(i)
                prog.append((i, _VIEW, [k, None, None], node, srcs, None, frees))
                continue
            if p.outs[i] is not None:
                planned.add(i)
            prog.append((i, _KERNEL, k, node, srcs, p.outs[i], frees))
    return prog


def execute(graph: Graph, store, feed: Mapping[str, Any],
            cache_of: Callable[[Tensor], Any]) -> list[Any]:
    """`store`: the WeightStore of the one backend, or {name: WeightStore} for a placed graph."""
    key = tuple(sorted((k, id(v)) for k, v in store.items())) if isinstance(store, dict) else id(store)
    if graph.program is None or graph.program[0] != key:
        index = {id(n): i for i, n in enumerate(graph.nodes)}
        outs = [(index[id(o)], (store[graph.backends[index[id(o)]]] if isinstance(store, dict) else store).backend)
                for o in graph.outputs]  # each output comes back through its own backend
        graph.program = (key, compile_program(graph, store), outs)
    vals: list[Any] = [None] * len(graph.nodes)
    for i, kind, fn, node, srcs, out, frees in graph.program[1]:
        if kind == _KERNEL:  # 2.
            args = [vals[j] for j in srcs]
            vals[i] = fn(node, *args) if out is None else fn(node, *args, out=out)
        elif kind == _VIEW:  # fn: [kernel, the source value it last saw, the view it made]
            v = vals[srcs[0]]
            if v is not fn[1]:
                fn[1], fn[2] = v, fn[0](node, v)
            vals[i] = fn[2]
        elif kind == _STATIC:  # 1.
            vals[i] = fn
        elif kind == _INPUT:
            vals[i] = fn(feed[node.name])
        elif kind == _CACHE:
            vals[i] = cache_of(node)
        else:
            vals[i] = copy(fn[0], fn[1], vals[srcs[0]])
        for j in frees:  # 3.
            vals[j] = None
    return [b.to_host(vals[j]) for j, b in graph.program[2]]
