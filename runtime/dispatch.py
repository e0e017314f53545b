"""Runs a graph on its backends. `compile_graph` resolves, once per cached graph, the passes:
0. place (runtime.placement, after fusion): which backend runs each node, the split into
   runs and the COPY nodes between them; one backend is the trivial placement;
1. plan (runtime.memory): liveness, and one host arena for the intermediates of the
   backends that take out= buffers;
2. bind: per node a step record: a weight's prepared value from its backend's store, an
   input's upload, a cache's lookup, a kernel with its planned buffer, a view, a copy.
`execute` then walks the steps in order each engine step: calls the kernel bound to its node
(`backend.bind`) on the sources (with `out=buffer` where planned), and drops each value after its last consumer (planned buffers stay in
the arena). A graph on one backend may instead be run by that backend's runner
(`Backend.graph_runner`: the cuda backend replays a captured CUDA graph)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from hearthlm.core.backend import CACHE, COPY, INPUT, KERNEL, STATIC, VIEW, Backend
from hearthlm.core.errors import BackendError
from hearthlm.core.graph import Graph, Op, Tensor
from hearthlm.runtime.memory import Arena, ExecPlan, OutBuffer, placeable, plan
from hearthlm.runtime.placement import Placement, place
from hearthlm.runtime.weights import WeightStore


@dataclass(slots=True, eq=False)
class Step:
    kind: str               # one of core.backend's step kinds
    index: int              # the node's index: where its value goes
    node: Tensor
    srcs: tuple[int, ...]   # indices of the source values
    frees: tuple[int, ...]  # indices of values to drop after this step
    fn: Any = None          # KERNEL/VIEW: the kernel bound to the node (Backend.bind); INPUT: the upload
    value: Any = None       # STATIC: the prepared weight
    out: Any = None         # KERNEL: the planned buffer, or None (the kernel allocates)
    pool: Any = None        # KERNEL, an output of a backend that plans memory: its OutBuffer
    src: Any = None         # COPY: the backend the value leaves
    dst: Any = None         # COPY: the backend it goes to
    seen: Any = None        # VIEW: the source value last seen, and the view made of it
    view: Any = None


@dataclass
class CompiledGraph:
    graph: Graph                 # fused (where asked), then split: nodes read sources on their own backend
    backends: list[str]          # per node: the name of the backend that runs it
    plan: ExecPlan
    steps: list[Step]
    outputs: list[tuple[int, Backend]]  # node index of each output, and the backend it comes back through
    n_splits: int                # runs of compute nodes on one backend
    n_copies: int                # COPY nodes between them
    runner: Any = None           # the backend's own way to run it (Backend.graph_runner), or None
    # made by walk's first run: the values list with the STATIC steps' values in place, and the other steps
    # (a LoRA step binds ~600 weights, each a walk iteration a step before); None again where st.value changes
    statics: list | None = None
    live: list | None = None

    def walk(self, feed: Mapping[str, np.ndarray], cache_of: Callable[[Tensor], Any],
             inputs: Mapping[int, Any] | None = None) -> list[Any]:
        """The steps in order (`walk` below): what a backend's runner calls to run or capture."""
        return walk(self, feed, cache_of, inputs)


def compile_graph(graph: Graph, placement: Placement, stores: Mapping[str, WeightStore],
                  arena: Arena | None = None) -> CompiledGraph:
    """Passes 0-2 for `graph` (fused or not); binding prepares the weights it reads. `arena`:
    a host buffer shared with other graphs (else the graph gets its own)."""
    s = place(graph, placement)  # 0.
    g, names = s.graph, s.backends
    be = [placement.backends[b] for b in names]
    p = plan(g, arena=[b.plans_memory and not n.op.props.moves for n, b in zip(g.nodes, be)], shared=arena)  # 1.
    index = {id(n): i for i, n in enumerate(g.nodes)}
    steps: list[Step] = []
    planned: set[int] = set()  # nodes whose value is an arena buffer or a view of one
    for i, (node, backend) in enumerate(zip(g.nodes, be)):  # 2.
        op = node.op
        st = Step(INPUT, i, node, tuple(index[id(x)] for x in node.srcs), tuple(index[id(d)] for d in p.frees[i]))
        if op is Op.INPUT:
            st.fn = backend.from_host
        elif op is Op.WEIGHT:
            st.kind, st.value = STATIC, stores[names[i]].get(node.params["weight"])
        elif op is Op.CACHE:
            st.kind = CACHE
        elif op.props.moves:
            st.kind, st.src, st.dst = COPY, placement.backends[node.params["src"]], backend
        else:
            if op not in backend.kernels:
                raise BackendError(f"backend {backend.name!r} has no kernel for {op.value} ({node.label})")
            st.fn = backend.bind(node)
            if op.props.view and st.srcs[0] in planned:
                # a view of an arena buffer: made once and reused while the source's value is the
                # same object (kernels that return their out= buffer make it so every step)
                st.kind = VIEW
                planned.add(i)
            else:
                st.kind, st.out = KERNEL, p.outs[i]
                if st.out is not None:
                    planned.add(i)
        steps.append(st)
    outs = [(index[id(o)], be[index[id(o)]]) for o in g.outputs]
    pools = arena.outs if arena is not None else {}
    for pos, (j, b) in enumerate(outs):  # the outputs the planner would have placed, were they not the caller's
        st = steps[j]
        if st.kind is KERNEL and b.plans_memory and placeable(st.node):
            st.pool = pools.setdefault(pos, OutBuffer())
    cg = CompiledGraph(g, names, p, steps, outs, s.n_splits, s.n_copies)
    if be and len(set(names)) == 1:
        cg.runner = be[0].graph_runner(cg)
    return cg


def execute(cg: CompiledGraph, feed: Mapping[str, np.ndarray], cache_of: Callable[[Tensor], Any],
            keep: frozenset[int] = frozenset()) -> list[Any]:
    """One run of a compiled graph: the outputs as numpy arrays, but those whose positions are in
    `keep`, left as their backend's values (cg.outputs names it), complete when this returns."""
    if cg.runner is not None:
        outs = cg.runner(feed, cache_of, keep)
        if outs is not None:
            return outs
    return [v if i in keep else b.to_host(v) for i, (v, (_j, b)) in enumerate(zip(walk(cg, feed, cache_of), cg.outputs))]


def walk(cg: CompiledGraph, feed: Mapping[str, np.ndarray], cache_of: Callable[[Tensor], Any],
         inputs: Mapping[int, Any] | None = None) -> list[Any]:
    """The steps in order: the outputs' values, on their backends. `inputs`: the INPUT nodes'
    values by node index, already placed (else each is uploaded from `feed`)."""
    if cg.live is None:
        cg.statics = [st.value if st.kind is STATIC else None for st in cg.steps]
        cg.live = [st for st in cg.steps if st.kind is not STATIC]
    vals: list[Any] = cg.statics.copy()
    for st in cg.live:
        kind = st.kind
        if kind is KERNEL:
            args = [vals[j] for j in st.srcs]
            out = st.out if st.pool is None else st.pool.take(st.node.shape, st.node.dtype)
            vals[st.index] = st.fn(*args) if out is None else st.fn(*args, out=out)
        elif kind is VIEW:
            v = vals[st.srcs[0]]
            if v is not st.seen:
                st.seen, st.view = v, st.fn(v)
            vals[st.index] = st.view
        elif kind is INPUT:
            vals[st.index] = st.fn(feed[st.node.name]) if inputs is None else inputs[st.index]
        elif kind is CACHE:
            vals[st.index] = cache_of(st.node)
        else:  # COPY
            vals[st.index] = st.dst.copy_from(st.src, vals[st.srcs[0]])
        for j in st.frees:
            vals[j] = None
    return [vals[j] for j, _b in cg.outputs]


def run(graph: Graph, where: Backend | Placement, feed: Mapping[str, np.ndarray],
        cache_of: Callable[[Tensor], Any], n_layer: int = 0) -> list[np.ndarray]:
    """Compile and execute once, with fresh weight stores (tests and tools)."""
    p = where if isinstance(where, Placement) else Placement.single(where, n_layer)
    return execute(compile_graph(graph, p, {n: WeightStore(b) for n, b in p.backends.items()}), feed, cache_of)
