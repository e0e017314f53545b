"""LoRA adapters chosen per request (Op.LORA): each row's low-rank products, grouped by adapter.

A row's result must not depend on what else is in the batch (a request's output is bitwise the
same alone and beside others), so each row is computed on its own in one fixed order, whatever
the row count or the threads: x a as L running sums (input j into sum j mod L, L fixed), added
in order; then (x a) b, each output's sum in rank order. Both inner loops run across lanes (L
inputs, the outputs), so they vectorize without reordering any sum; rows spread over the
threads. Not BLAS over a group: its blocking follows the group's row count. No fastmath."""
from __future__ import annotations

import numba
import numpy as np

from hearthlm.backends.cpu.halfs import f32
from hearthlm.backends.cpu.qtypes import PackedWeight

L = 128  # lanes of x a's sums


def _lora_rows(y, x, s, col, alpha, a, b):
    """y[t] += s_t * ((a x[t]) b) for each row t whose scale s[t, col] is not 0; s_t = that scale *
    alpha / rank (alpha 0: the scale), in float32 as llama.cpp's get_scale. y (n, n_out), x (n, n_in),
    s (n, S) float32; a (r, n_in) (the GGUF's lora_a), b (r, n_out): float32, or float16 bits (uint16),
    widened as read."""
    r, n_in = a.shape
    n_out = b.shape[1]
    nb = n_in // L
    for t in numba.prange(y.shape[0]):
        sc = s[t, col]
        if sc == 0:
            continue
        if alpha != 0:
            sc = np.float32(np.float32(sc * alpha) / np.float32(r))
        xt, yt = x[t], y[t]
        tmp = np.empty(r, np.float32)
        acc = np.empty(L, np.float32)
        for i in range(r):
            ai = a[i]
            acc[:] = 0
            for jb in range(nb):
                seg, xs = ai[jb * L:(jb + 1) * L], xt[jb * L:(jb + 1) * L]
                for q in range(L):
                    acc[q] += f32(seg[q]) * xs[q]
            tot = np.float32(0)
            for q in range(L):
                tot += acc[q]
            for j in range(nb * L, n_in):
                tot += f32(ai[j]) * xt[j]
            tmp[i] = tot
        d = np.zeros(n_out, np.float32)
        for i in range(r):
            ti, bi = tmp[i], b[i]
            for o in range(n_out):
                d[o] += f32(bi[o]) * ti
        for o in range(n_out):
            yt[o] += d[o] * sc


# the same loops, so the same sums: threads for a step's worth of rows, one for a decoding row (a
# parallel region's start, ~20 us, costs more than its products, ~5-12 us at Qwen2.5-0.5B's shapes)
lora_rows = numba.njit(parallel=True, cache=True, nogil=True)(_lora_rows)
lora_rows_1 = numba.njit(cache=True, nogil=True)(_lora_rows)
PAR_MIN_MACS = 1 << 19  # multiply-adds of a call from which it goes parallel (over rows)


def _values(w) -> np.ndarray:
    """A prepared adapter matrix as the kernel reads it: float32, or F16 as its uint16 bits (a
    narrow one is kept as a float32 array, a wide one packed "f32" or "half")."""
    if isinstance(w, PackedWeight):
        assert w.layout == "f32" or w.layout == "half" and w.ggml_type == 1, f"LoRA weights: {w.layout}"
        return w.w if w.layout == "f32" else w.qs
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
    for i, (col, alpha) in enumerate(zip(node.params["cols"], node.params["alphas"])):
        a, b = _values(ab[2 * i]), _values(ab[2 * i + 1])
        big = n > 1 and n * a.shape[0] * (a.shape[1] + b.shape[1]) >= PAR_MIN_MACS
        (lora_rows if big else lora_rows_1)(o2, x2, s, col, np.float32(alpha), a, b)
    return out
