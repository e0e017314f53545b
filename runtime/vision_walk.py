"""A compiled graph run a part at a time (runtime.vision's turns beside decoding): its steps in
order as dispatch.walk runs them, stopping where a turn's time is spent, and a big row-wise kernel
(a projection, attention's queries) in blocks of rows sized to the time left. ViT layers are
row-wise but for attention, which takes its query rows in blocks over all keys (its "rows" param),
so a turn can end anywhere in a layer: no stall much longer than the turn asked for."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

import numpy as np

from hearthlm.core.backend import CACHE, COPY, INPUT, KERNEL, STATIC, VIEW
from hearthlm.core.graph import Op
from hearthlm.runtime.dispatch import CompiledGraph, execute
from hearthlm.runtime.placement import Placement

# the ops run in blocks of rows: which sources are cut by rows (attention: none, it is told its query rows)
ROW_SOURCES = {Op.MUL_MAT: (1,), Op.MUL_MAT_ADD: (1, 2), Op.FFN_GLU: (2,), Op.ATTN_FULL: ()}
RATE_GUESS = 5e10  # FLOP/s of an op kind before one has run (a block's rows are sized by it)
MIN_ROWS = 32      # the smallest block (a matmul of fewer rows wastes its packed weights' reads)


def flops_per_row(node) -> float:
    """Multiply-adds x 2 per output row of a row-split op (attention: over all its keys, an upper bound
    where images or windows split them)."""
    if node.op is Op.ATTN_FULL:
        q, k, v = node.srcs[:3]
        return 2.0 * k.shape[0] * q.shape[1] * (q.shape[2] + v.shape[2])
    w = node.srcs[0]
    return 2.0 * w.shape[0] * w.shape[1] * (2 if node.op is Op.FFN_GLU else 1)


class Walk:
    """One run of `cg` on `feed`, resumable: `run` goes on from where the last one stopped."""

    def __init__(self, cg: CompiledGraph, feed: Mapping[str, np.ndarray], placement: Placement) -> None:
        self.cg, self.feed, self.placement = cg, feed, placement
        self.vals: list[Any] = [None] * len(cg.steps)
        self.i = 0          # the next step
        self.row = 0        # rows of step i done, where it runs in blocks
        self.full: Any = None  # and its output so far

    def run(self, budget_s: float | None, rates: dict, at_least_one: bool = True) -> list[np.ndarray] | None:
        """Steps for about budget_s seconds (None: to the end, each kernel whole); `rates` (FLOP/s per
        op kind) size the blocks and learn from them. The outputs once the last step ran, else None."""
        if budget_s is None and self.i == 0:  # all at once: as any graph runs (a backend's own runner too)
            return execute(self.cg, self.feed, _no_cache)
        t0 = time.perf_counter()
        steps = self.cg.steps
        while self.i < len(steps):
            st = steps[self.i]
            left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
            if left is not None and left <= 0 and not at_least_one:
                return None
            if not self._splits(st):
                self._done(st, self._step(st))
                at_least_one = False
                continue
            n, per_row = st.node.shape[0], flops_per_row(st.node) / rates[st.node.op]
            rows = n - self.row if left is None else max(MIN_ROWS, int(left / per_row))
            if left is not None and not at_least_one and rows * per_row > 1.5 * left:  # not even a small block fits
                return None
            t, r0, r1 = time.perf_counter(), self.row, min(n, self.row + rows)
            if r0 == 0 and r1 == n:  # whole, as dispatch.walk runs it
                self._done(st, self._step(st))
            else:
                self._block(st, r0, r1)
                self.row = r1
                if r1 == n:
                    self._done(st, self.full)
            self._learn(rates, st.node, r1 - r0, time.perf_counter() - t)
            at_least_one = False
        return [b.to_host(self.vals[j]) for j, b in self.cg.outputs]

    @staticmethod
    def _learn(rates: dict, node, rows: int, dt: float) -> None:
        """The op kind's FLOP/s, half from this run (of a block big enough to say it)."""
        if rows >= MIN_ROWS and dt > 0:
            rates[node.op] = 0.5 * rates[node.op] + 0.5 * rows * flops_per_row(node) / dt

    def _splits(self, st) -> bool:
        """Whether step st runs in blocks of rows: a row-wise op of host arrays, its rows leading."""
        node = st.node
        if st.kind is not KERNEL or node.op not in ROW_SOURCES or len(node.shape) != 2:
            return False
        if node.op is not Op.ATTN_FULL and node.srcs[0].op is not Op.WEIGHT:
            return False
        cut = ROW_SOURCES[node.op] or (0,)
        return all(isinstance(self.vals[st.srcs[j]], np.ndarray) and self.vals[st.srcs[j]].shape[0] == node.shape[0]
                   for j in cut) and (st.out is None or st.out.flags.c_contiguous)

    def _block(self, st, r0: int, r1: int) -> None:
        """Rows r0..r1 of step st's output, into its buffer (made at its first block where unplanned)."""
        node = st.node
        if r0 == 0:
            self.full = st.out if st.out is not None else np.empty(node.shape, np.float32)
        params = {**node.params, "rows": (r0, r1)} if node.op is Op.ATTN_FULL else node.params
        part = dataclasses.replace(node, shape=(r1 - r0, *node.shape[1:]), params=params)
        fn = self.placement.backends[self.cg.backends[st.index]].bind(part)
        args = [self.vals[j] for j in st.srcs]
        for j in ROW_SOURCES[node.op]:
            args[j] = args[j][r0:r1]
        view = self.full.reshape(node.shape[0], -1)[r0:r1]
        y = fn(*args) if st.out is None else fn(*args, out=view)
        if y is not view:
            view[...] = np.asarray(y).reshape(view.shape)

    def _step(self, st) -> Any:
        """Step st whole (dispatch.walk's)."""
        kind = st.kind
        if kind is KERNEL:
            args = [self.vals[j] for j in st.srcs]
            return st.fn(*args) if st.out is None else st.fn(*args, out=st.out)
        if kind is VIEW:
            v = self.vals[st.srcs[0]]
            if v is not st.seen:
                st.seen, st.view = v, st.fn(v)
            return st.view
        if kind is STATIC:
            return st.value
        if kind is INPUT:
            return st.fn(self.feed[st.node.name])
        if kind is CACHE:
            _no_cache(st.node)
        assert kind is COPY
        return st.dst.copy_from(st.src, self.vals[st.srcs[0]])

    def _done(self, st, value: Any) -> None:
        self.vals[st.index] = value
        for j in st.frees:
            self.vals[j] = None
        self.i, self.row, self.full = self.i + 1, 0, None


def _no_cache(node):
    raise AssertionError(f"a vision tower reads no cache ({node.label})")
