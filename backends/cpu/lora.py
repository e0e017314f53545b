"""LoRA adapters chosen per request (Op.LORA): each row's low-rank products, grouped by adapter.

A row's result must not depend on what else is in the batch (a request's output is bitwise the
same alone and beside others), so each row is computed on its own, in one fixed order: both
products as sums of scaled rows (x_j times row j of A^T, then t_i times row i of B^T), which
vectorize across the output without reordering any sum. Not BLAS over a group: its blocking
follows the group's row count. No fastmath for the same reason."""
from __future__ import annotations

import numba
import numpy as np

from hearthlm.backends.cpu.qtypes import PackedWeight


@numba.njit(parallel=True, cache=True, nogil=True)
def lora_rows(y, x, s, col, alpha, a, b):
    """y[t] += s_t * ((x[t] a) b) for each row t whose scale s[t, col] is not 0; s_t = scale *
    alpha / rank (scale where alpha is 0), in float32 as llama.cpp's get_scale.
    y (n, n_out), x (n, n_in), s (n, S) float32; a (n_in, r), b (r, n_out) float32."""
    n_in, r = a.shape
    n_out = b.shape[1]
    for t in numba.prange(y.shape[0]):
        scale = s[t, col]
        if scale == 0:
            continue
        if alpha != 0:
            scale = np.float32(np.float32(scale * np.float32(alpha)) / np.float32(r))
        tmp = np.zeros(r, np.float32)
        for j in range(n_in):
            xj = x[t, j]
            for i in range(r):
                tmp[i] += a[j, i] * xj
        d = np.zeros(n_out, np.float32)
        for i in range(r):
            ti = tmp[i]
            for o in range(n_out):
                d[o] += b[i, o] * ti
        for o in range(n_out):
            y[t, o] += d[o] * scale


def _f32(w) -> np.ndarray:
    """A prepared adapter matrix as float32 (a narrow one is kept as an array, a wide one packed "f32")."""
    if isinstance(w, PackedWeight):
        assert w.layout == "f32", f"LoRA weights are float32, not {w.layout}"
        return w.w
    return np.ascontiguousarray(w, np.float32)


def lora(node, y, x, s, *ab, out=None):
    """Op.LORA: y plus each adapter's products on its rows (into `out`, which may be y's buffer)."""
    n = y.shape[0]
    if out is None:
        out = np.array(y, np.float32, order="C")
    elif not np.shares_memory(out, y):
        np.copyto(out, y)
    o2 = out.reshape(n, y.shape[-1])
    x2 = np.ascontiguousarray(x, np.float32).reshape(n, x.shape[-1])
    s2 = np.ascontiguousarray(s, np.float32)
    for i, (col, alpha) in enumerate(zip(node.params["cols"], node.params["alphas"])):
        if s2[:, col].any():
            lora_rows(o2, x2, s2, col, np.float32(alpha), _f32(ab[2 * i]), _f32(ab[2 * i + 1]))
    return out
