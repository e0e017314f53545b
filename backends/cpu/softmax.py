"""The softmax inside attn_full's blocks on the host (core.array_ops.attn_full's `softmax`): the
block's scores come transposed, (keys, query rows), as BLAS makes them fastest (keys as the long
side; measured 85-90 vs 65-70 GFLOP/s at SigLIP's head size 72); each query's softmax runs down a
column, vectorized across the query rows: one pass for the maxima, one for exp (ops.fexp) and the
sums, where numpy takes four. The GIL released: attn_full's threads run blocks side by side."""
from __future__ import annotations

import numba
import numpy as np

from .ops import _JIT, fexp


@numba.njit(**_JIT)
def exp_cols(s, mx, sums):
    """s (m, r) float32, C order: each column becomes exp(column - its max) in place; sums[i]
    its sum (mx: scratch of r floats)."""
    m, r = s.shape
    for i in range(r):
        mx[i] = s[0, i]
        sums[i] = np.float32(0.0)
    for j in range(1, m):
        row = s[j]
        for i in range(r):
            x = row[i]
            mx[i] = x if x > mx[i] else mx[i]
    for j in range(m):
        row = s[j]
        for i in range(r):
            e = fexp(row[i] - mx[i])
            row[i] = e
            sums[i] += e


def softmax_cols(s: np.ndarray) -> np.ndarray:
    """(h, m, r) float32 scores, C order -> exp(s - column max) in place; returns the sums (h, 1, r)."""
    h, _, r = s.shape
    mx, sums = np.empty(r, np.float32), np.empty((h, 1, r), np.float32)
    for i in range(h):
        exp_cols(s[i], mx, sums[i, 0])
    return sums
