"""The memory planner (ggml-alloc's idea): walk the graph once in execution order, give
each intermediate an offset in one arena when it is produced and hand its bytes back when
its last consumer has run, so peak memory follows liveness, not graph size. A node may take
over a dying source's buffer (in place) where its kernel allows. Done once per cached graph;
each step then only runs kernels into fixed buffers."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hearthlm.runtime.graph import Graph, Op, Tensor

ALIGN = 64  # bytes: a cache line, and what SIMD loads like
UNPLANNED = (Op.INPUT, Op.WEIGHT, Op.CACHE, Op.SET_ROWS, Op.ROPE_SET_ROWS)  # fed, prepared or persistent
VIEWS = (Op.RESHAPE, Op.SLICE)  # share their source's buffer
# op -> which sources the output may overwrite (the kernel reads each element before writing it)
INPLACE = {Op.ADD: (0, 1), Op.MUL: (0, 1), Op.SCALE: (0,), Op.SILU: (0,), Op.GELU: (0,), Op.TANH: (0,), Op.ROPE: (0,),
           Op.RMS_NORM: (0,), Op.RMS_NORM_MUL: (0,), Op.RMS_NORM_MUL_ADD: (2, 0), Op.GLU: (0, 1),
           Op.SOFT_MAX: (0,), Op.MUL_MAT_ADD: (2,), Op.ADD_N: (0, 1, 2, 3)}


@dataclass
class ExecPlan:
    frees: list[list[Tensor]]          # per node index: values to drop after it ran
    offsets: dict[int, int] = field(default_factory=dict)  # id(node) -> arena byte offset
    arena_bytes: int = 0               # the planned peak
    no_reuse_bytes: int = 0            # every intermediate in its own buffer
    liveness_peak_bytes: int = 0       # fresh arrays dropped at last use (dispatch without a plan)
    outs: list[np.ndarray | None] = field(default_factory=list)  # per node index: its buffer


def nbytes(t: Tensor) -> int:
    return int(np.prod(t.shape)) * t.dtype.itemsize


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def last_uses(graph: Graph) -> dict[int, int]:
    """id(node) -> index of its last consumer (len(nodes) for outputs)."""
    last: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.srcs:
            last[id(s)] = i
    for o in graph.outputs:
        last[id(o)] = len(graph.nodes)
    return last


class _FreeList:
    """Best-fit free blocks of an arena that grows at its end (ggml's dynamic allocator)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.end = 0

    def alloc(self, size: int) -> int:
        fits = [(s, i) for i, (o, s) in enumerate(self.blocks) if s >= size]
        if not fits:
            if self.blocks and sum(self.blocks[-1]) == self.end:  # grow the free block at the end
                off = self.blocks.pop()[0]
            else:
                off = self.end
            self.end = max(self.end, off + size)
            return off
        s, i = min(fits)
        off = self.blocks[i][0]
        self.blocks[i] = (off + size, s - size)
        if s == size:
            del self.blocks[i]
        return off

    def free(self, off: int, size: int) -> None:
        self.blocks.append((off, size))
        self.blocks.sort()
        merged = [self.blocks[0]]
        for o, s in self.blocks[1:]:
            po, ps = merged[-1]
            merged[-1:] = [(po, ps + s)] if po + ps == o else [(po, ps), (o, s)]
        self.blocks = merged


def plan(graph: Graph, *, arena: bool) -> ExecPlan:
    """Liveness for every graph; arena offsets (and numpy views) when `arena` (the backend
    takes out= buffers). Outputs keep fresh arrays: the caller holds them past the step."""
    nodes = graph.nodes
    last = last_uses(graph)
    # 1. views: a RESHAPE shares its root's buffer, which then lives until the view's last use
    root: dict[int, Tensor] = {}
    for n in nodes:
        root[id(n)] = root[id(n.srcs[0])] if n.op in VIEWS else n
    end: dict[int, int] = {}
    for n in nodes:
        r = root[id(n)]
        end[id(r)] = max(end.get(id(r), -1), last.get(id(n), -1))
    outs = {id(root[id(o)]) for o in graph.outputs}
    planned = lambda n: n.op not in UNPLANNED and n.op not in VIEWS and id(n) not in outs  # noqa: E731
    # 2. frees: what dispatch drops after each node (unplanned values, and all of them when no arena)
    frees: list[list[Tensor]] = [[] for _ in nodes]
    for n in nodes:
        if n.op not in (Op.WEIGHT, Op.CACHE) and id(n) in last and last[id(n)] < len(nodes):
            frees[last[id(n)]].append(n)
    p = ExecPlan(frees)
    # 3. offsets: walk in order; in place into a dying source, else best fit; then free the dead
    fl, live, peak = _FreeList(), 0, 0
    dies_at: dict[int, list[Tensor]] = {}
    handed: set[int] = set()
    for i, n in enumerate(nodes):
        if planned(n):
            size = _align(nbytes(n))
            p.no_reuse_bytes += size
            live += size
            peak = max(peak, live)
            donor = None
            for j in INPLACE.get(n.op, ()):
                s = root[id(n.srcs[j])] if j < len(n.srcs) else None
                if (s is not None and id(s) in p.offsets and end[id(s)] == i and nbytes(s) == nbytes(n)
                        and n.srcs[j].shape == n.shape and s.dtype == n.dtype):
                    donor = s
                    break
            if donor is not None:
                p.offsets[id(n)] = p.offsets[id(donor)]
                handed.add(id(donor))  # its bytes are n's now
            else:
                p.offsets[id(n)] = fl.alloc(size)
            dies_at.setdefault(max(end[id(n)], i), []).append(n)
        for d in dies_at.pop(i, ()):
            if id(d) not in handed:
                fl.free(p.offsets[id(d)], _align(nbytes(d)))
            live -= _align(nbytes(d))
    p.arena_bytes, p.liveness_peak_bytes = fl.end, peak
    if arena:
        buf = np.empty(max(p.arena_bytes, 1), np.uint8)
        p.outs = [None if id(n) not in p.offsets else
                  buf[p.offsets[id(n)]:p.offsets[id(n)] + nbytes(n)].view(n.dtype).reshape(n.shape) for n in nodes]
    else:  # offsets stay, as the plan's record (and for tests); kernels allocate
        p.outs = [None] * len(nodes)
    return p
