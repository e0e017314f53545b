"""The memory planner (ggml-alloc's idea): walk the graph once in execution order, give
each intermediate an offset in one arena when it is produced and hand its bytes back when
its last consumer has run, so peak memory follows liveness, not graph size. A node may take
over a dying source's buffer (in place) where its kernel allows. Done once per cached graph;
each step then only runs kernels into fixed buffers."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.graph import Graph, Op, Tensor

ALIGN = 64  # bytes: a cache line, and what SIMD loads like


@dataclass
class ExecPlan:
    frees: list[list[Tensor]]          # per node index: values to drop after it ran
    offsets: dict[int, int] = field(default_factory=dict)  # id(node) -> arena byte offset
    arena_bytes: int = 0               # the planned peak
    no_reuse_bytes: int = 0            # every intermediate in its own buffer
    liveness_peak_bytes: int = 0       # fresh arrays dropped at last use (dispatch without a plan)
    outs: list[np.ndarray | None] = field(default_factory=list)  # per node index: its buffer
    own: list[bool] = field(default_factory=list)  # per node index: its buffer is in the arena


class Arena:
    """The host buffer of planned intermediates, shared by all the graphs of a graph cache:
    one graph runs at a time (the engine's one thread), so one buffer sized for the largest
    plan serves them all, and memory stays that size whatever shapes come. Growing replaces
    the buffer; graphs bound to the old one rebind (`bind`), and it goes with their views."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)
        self.outs: dict[int, OutBuffer] = {}  # by output position: the graphs' outputs (OutBuffer)

    def fit(self, n: int) -> np.ndarray:
        if n > self.buf.nbytes:
            self.buf = np.empty(n, np.uint8)
        return self.buf


class OutBuffer:
    """The buffer of one output position (the logits, say) for the next run, where nothing outside
    still holds the last one. Outputs are the caller's past the step, so they stay out of the
    arena; but a fresh array each step is fresh pages each step, faulted in inside the kernel's
    time: logits of 16-64 rows are 10-67 MB (Gemma 3's head at 64 rows, 2 cores: 44 ms into a
    kept buffer, 51 into a fresh one). A caller's output is a view of the buffer, so holding it
    (or a view of it) shows in the buffer's reference count: then the run gets a new buffer and
    the held one is left alone. One per position for all the graphs of a graph cache (with its
    Arena): memory for the largest output only, as the arena's; none kept past KEEP_BYTES."""

    __slots__ = ("buf",)
    KEEP_BYTES = 256 << 20  # a one-off (a 512-row prompt's log-probs: 0.5 GB) is not kept

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        b = self.buf
        # 3: self.buf, b, and getrefcount's argument
        if b is None or b.nbytes < n or sys.getrefcount(b) > 3:
            b = np.empty(max(n, 1), np.uint8)
            self.buf = b if n <= self.KEEP_BYTES else None
        return np.ndarray(shape, dtype, buffer=b)  # its base is b: holding it counts


def placeable(n: Tensor) -> bool:
    """A node whose value a buffer of the planner's may hold: not fed, prepared or persistent,
    not a view or a copy (outputs too, by OutBuffer, though not in the arena)."""
    pr = n.op.props
    return not (pr.bound or pr.writes_cache or pr.view or pr.moves)


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


def plan(graph: Graph, *, arena: bool | list[bool], shared: Arena | None = None) -> ExecPlan:
    """Liveness for every graph; arena offsets for all intermediates, and numpy views of one
    arena (its own, or `shared`) as the buffers of the nodes whose backend takes out= buffers:
    `arena`, per node (or one bool for all). Outputs keep fresh arrays: the caller holds them
    past the step."""
    nodes = graph.nodes
    last = last_uses(graph)
    # 1. views: a RESHAPE shares its root's buffer, which then lives until the view's last use
    root: dict[int, Tensor] = {}
    for n in nodes:
        root[id(n)] = root[id(n.srcs[0])] if n.op.props.view else n
    end: dict[int, int] = {}
    for n in nodes:
        r = root[id(n)]
        end[id(r)] = max(end.get(id(r), -1), last.get(id(n), -1))
    outs = {id(root[id(o)]) for o in graph.outputs}
    # fed, prepared, persistent, views and copies have buffers of their own
    planned = lambda n: placeable(n) and id(n) not in outs  # noqa: E731
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
            for j in n.op.props.inplace:
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
    p.own = [arena] * len(nodes) if isinstance(arena, bool) else list(arena)
    if any(p.own):
        bind(p, nodes, shared.fit(p.arena_bytes) if shared is not None else np.empty(max(p.arena_bytes, 1), np.uint8))
    else:
        p.outs = [None] * len(nodes)
    return p


def bind(p: ExecPlan, nodes: list[Tensor], buf: np.ndarray) -> None:
    """The nodes' buffers as views of `buf` at their planned offsets. Offsets stay for the
    nodes of backends that allocate, as the plan's record (and for tests)."""
    p.outs = [None if id(n) not in p.offsets or not mine else
              buf[p.offsets[id(n)]:p.offsets[id(n)] + nbytes(n)].view(n.dtype).reshape(n.shape)
              for n, mine in zip(nodes, p.own)]
