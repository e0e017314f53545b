"""F16 and BF16 weights kept at 2 bytes a weight (float32 copies would double a model's memory
and the bytes each decode token streams). Rows are widened to float32 into a small per-thread
buffer, then dotted with each token; for many tokens, matmul.py widens tiles for BLAS.

numba has no float16 and no scalar bitcast, so the widening writes float32 bit patterns into
a uint32 buffer viewed as float32. F16: sign | exponent+mantissa << 13 is the value times
2**-112 (also for subnormals, which become float32 subnormals); one multiply rebiases it.
Inf/NaN get an all-ones exponent first, which the multiply keeps.
"""

import numba
import numpy as np
from numba import prange

_JIT = dict(cache=True, fastmath=True, nogil=True)
ROWS_PER_TASK = 32  # rows sharing one widening buffer in the parallel loop
_F16_REBIAS = np.float32(2.0**112)


@numba.njit(inline="always", **_JIT)
def _widen_row(h, is_f16, bits, f32):
    """h (n,) uint16 -> f32 (n,) float32; bits is f32's uint32 view (the same memory)."""
    n = h.shape[0]
    if is_f16:
        for j in range(n):
            v = np.uint32(h[j])
            em = v & np.uint32(0x7FFF)
            inf_nan = np.uint32(0x7F800000) if em >= np.uint32(0x7C00) else np.uint32(0)
            bits[j] = ((v & np.uint32(0x8000)) << np.uint32(16)) | (em << np.uint32(13)) | inf_nan
        for j in range(n):
            f32[j] = f32[j] * _F16_REBIAS
    else:
        for j in range(n):
            bits[j] = np.uint32(h[j]) << np.uint32(16)


@numba.njit(parallel=True, **_JIT)
def dot_half(w, is_f16, x, y):
    """w (n_rows, n_cols) uint16 bits, x (n_tok, n_cols) float32 -> y (n_tok, n_rows)."""
    n_rows, n_cols = w.shape
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        f32 = np.empty(n_cols, dtype=np.float32)
        bits = f32.view(np.uint32)
        for r in range(task * ROWS_PER_TASK, min((task + 1) * ROWS_PER_TASK, n_rows)):
            _widen_row(w[r], is_f16, bits, f32)
            for t in range(x.shape[0]):
                acc = np.float32(0.0)
                for j in range(n_cols):
                    acc += f32[j] * x[t, j]
                y[t, r] = acc


@numba.njit(**_JIT)
def widen_rows(w, is_f16, rows, out):
    """out[i] = row rows[i] of w as float32 (n, n_cols). Serial, like the other tile kernels."""
    bits = out.view(np.uint32)
    for i in range(rows.shape[0]):
        _widen_row(w[rows[i]], is_f16, bits[i], out[i])
