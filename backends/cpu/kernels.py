"""numba kernels behind matmul.py: activation quantization, integer dot products, dequantization.

Layouts are those of qtypes.py. A dot product over one sub-block of weights
w = d*code + m against activations a = xd*xq is d*xd*sum(code*xq) + m*xs, where
xs = xd*sum(xq) over the sub-block: integers inside, one float multiply-add per sub-block.
"""

import numba
import numpy as np
from numba import prange

_JIT = dict(cache=True, fastmath=True, nogil=True)


@numba.njit(**_JIT)
def _quantize_rows(x, xq, xd, xs, sub):
    n_tok, n_cols = x.shape
    for t in range(n_tok):
        for b in range(xd.shape[1]):
            c0 = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                if c0 + j < n_cols:
                    amax = max(amax, abs(x[t, c0 + j]))
            scale = amax / np.float32(32767.0)
            inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            xd[t, b] = scale
            for j in range(32):
                v = x[t, c0 + j] if c0 + j < n_cols else np.float32(0.0)
                xq[t, c0 + j] = np.int16(np.rint(v * inv))
        for s in range(xs.shape[1]):
            acc = np.int32(0)
            for j in range(sub):
                acc += np.int32(xq[t, s * sub + j])
            xs[t, s] = np.float32(acc) * xd[t, (s * sub) // 32]


def quantize_x(x, n_pad, sub):
    """x (n_tok, n_cols) f32 -> xq (n_tok, n_pad) int16, xd (n_tok, n_pad//32), xs (n_tok, n_pad//sub)."""
    n_tok = x.shape[0]
    xq = np.empty((n_tok, n_pad), dtype=np.int16)
    xd = np.empty((n_tok, n_pad // 32), dtype=np.float32)
    xs = np.empty((n_tok, n_pad // sub), dtype=np.float32)
    _quantize_rows(x, xq, xd, xs, sub)
    return xq, xd, xs


@numba.njit(parallel=True, **_JIT)
def dot_nib32(qs, d, m, xq, xd, xs, y):
    """4-bit codes, a scale per 32. qs (n_rows, n_pad//2) -> y (n_tok, n_rows)."""
    n_rows = qs.shape[0]
    n_grp = qs.shape[1] // 32
    for r in prange(n_rows):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(n_grp):
                s0 = np.int32(0)
                s1 = np.int32(0)
                for j in range(32):
                    b = np.int32(qs[r, g * 32 + j])
                    s0 += (b & 15) * np.int32(xq[t, g * 64 + j])
                    s1 += (b >> 4) * np.int32(xq[t, g * 64 + 32 + j])
                k = 2 * g
                acc += d[r, k] * xd[t, k] * np.float32(s0) + m[r, k] * xs[t, k]
                acc += d[r, k + 1] * xd[t, k + 1] * np.float32(s1) + m[r, k + 1] * xs[t, k + 1]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_nib16(qs, d, m, xq, xd, xs, y):
    """4-bit codes, a scale per 16 (Q2_K, Q3_K)."""
    n_rows = qs.shape[0]
    n_grp = qs.shape[1] // 32
    for r in prange(n_rows):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(n_grp):
                for h in range(2):  # 16 bytes: low nibbles are sub-block 4g+h, high ones 4g+2+h
                    s0 = np.int32(0)
                    s1 = np.int32(0)
                    for j in range(16):
                        b = np.int32(qs[r, g * 32 + h * 16 + j])
                        s0 += (b & 15) * np.int32(xq[t, g * 64 + h * 16 + j])
                        s1 += (b >> 4) * np.int32(xq[t, g * 64 + 32 + h * 16 + j])
                    k = 4 * g + h
                    acc += d[r, k] * xd[t, 2 * g] * np.float32(s0) + m[r, k] * xs[t, k]
                    acc += d[r, k + 2] * xd[t, 2 * g + 1] * np.float32(s1) + m[r, k + 2] * xs[t, k + 2]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_i8_32(qs, d, m, xq, xd, xs, y):
    """int8 codes, a scale per 32. qs (n_rows, n_pad)."""
    n_rows = qs.shape[0]
    n_sub = d.shape[1]
    for r in prange(n_rows):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for k in range(n_sub):
                s = np.int32(0)
                for j in range(32):
                    s += np.int32(qs[r, k * 32 + j]) * np.int32(xq[t, k * 32 + j])
                acc += d[r, k] * xd[t, k] * np.float32(s) + m[r, k] * xs[t, k]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_i8_16(qs, d, m, xq, xd, xs, y):
    """int8 codes, a scale per 16 (Q6_K)."""
    n_rows = qs.shape[0]
    n_sub = d.shape[1]
    for r in prange(n_rows):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for k in range(n_sub):
                s = np.int32(0)
                for j in range(16):
                    s += np.int32(qs[r, k * 16 + j]) * np.int32(xq[t, k * 16 + j])
                acc += d[r, k] * xd[t, k // 2] * np.float32(s) + m[r, k] * xs[t, k]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dequant_nib(qs, d, m, sub, rows, out):
    """out[i] = row rows[i] as float32 (n, n_pad)."""
    for i in prange(rows.shape[0]):
        r = rows[i]
        for g in range(qs.shape[1] // 32):
            for j in range(32):
                b = qs[r, g * 32 + j]
                c0 = g * 64 + j
                c1 = c0 + 32
                out[i, c0] = d[r, c0 // sub] * np.float32(b & 15) + m[r, c0 // sub]
                out[i, c1] = d[r, c1 // sub] * np.float32(b >> 4) + m[r, c1 // sub]


@numba.njit(parallel=True, **_JIT)
def dequant_i8(qs, d, m, sub, rows, out):
    for i in prange(rows.shape[0]):
        r = rows[i]
        for c in range(qs.shape[1]):
            out[i, c] = d[r, c // sub] * np.float32(qs[r, c]) + m[r, c // sub]
