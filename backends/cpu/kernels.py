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


# The inner loops below have constant trip counts and several independent sums on purpose:
# LLVM then vectorizes them whole (vpmovzxbw + vpmaddwd); one 32-long sum per loop gets a
# vector loop that never runs (its step is 64) plus a slow remainder loop. The casts keep
# the sums in int32 (numba widens integer arithmetic to int64 otherwise).


@numba.njit(parallel=True, **_JIT)
def dot_nib32(qs, d, m, xq, xd, xs, y):
    """4-bit codes, a scale per 32. qs (n_rows, n_pad//2) uint8 -> y (n_tok, n_rows)."""
    for r in prange(qs.shape[0]):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(qs.shape[1] // 32):  # 64 weights: low nibbles, then high nibbles
                s0 = np.int32(0)
                s1 = np.int32(0)
                for j in range(32):
                    b = qs[r, g * 32 + j]
                    s0 = np.int32(s0 + np.int32(np.int16(b & 15)) * np.int32(xq[t, g * 64 + j]))
                    s1 = np.int32(s1 + np.int32(np.int16(b >> 4)) * np.int32(xq[t, g * 64 + 32 + j]))
                k = 2 * g
                acc += d[r, k] * xd[t, k] * np.float32(s0) + m[r, k] * xs[t, k]
                acc += d[r, k + 1] * xd[t, k + 1] * np.float32(s1) + m[r, k + 1] * xs[t, k + 1]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_nib16(qs, d, m, xq, xd, xs, y):
    """4-bit codes, a scale per 16 (Q2_K, Q3_K)."""
    for r in prange(qs.shape[0]):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(qs.shape[1] // 32):
                o = g * 32
                s0 = np.int32(0)
                s1 = np.int32(0)
                s2 = np.int32(0)
                s3 = np.int32(0)
                for j in range(16):  # sub-blocks 4g..4g+3: low nibbles of 2 x 16 bytes, then high
                    b0 = qs[r, o + j]
                    b1 = qs[r, o + 16 + j]
                    s0 = np.int32(s0 + np.int32(np.int16(b0 & 15)) * np.int32(xq[t, 2 * o + j]))
                    s1 = np.int32(s1 + np.int32(np.int16(b1 & 15)) * np.int32(xq[t, 2 * o + 16 + j]))
                    s2 = np.int32(s2 + np.int32(np.int16(b0 >> 4)) * np.int32(xq[t, 2 * o + 32 + j]))
                    s3 = np.int32(s3 + np.int32(np.int16(b1 >> 4)) * np.int32(xq[t, 2 * o + 48 + j]))
                k = 4 * g
                acc += (d[r, k] * np.float32(s0) + d[r, k + 1] * np.float32(s1)) * xd[t, 2 * g]
                acc += (d[r, k + 2] * np.float32(s2) + d[r, k + 3] * np.float32(s3)) * xd[t, 2 * g + 1]
                acc += m[r, k] * xs[t, k] + m[r, k + 1] * xs[t, k + 1]
                acc += m[r, k + 2] * xs[t, k + 2] + m[r, k + 3] * xs[t, k + 3]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_i8_32(qs, d, m, xq, xd, xs, y):
    """int8 codes, a scale per 32. qs (n_rows, n_pad) int8."""
    for r in prange(qs.shape[0]):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(qs.shape[1] // 64):
                o = g * 64
                s0 = np.int32(0)
                s1 = np.int32(0)
                for j in range(32):
                    s0 = np.int32(s0 + np.int32(qs[r, o + j]) * np.int32(xq[t, o + j]))
                    s1 = np.int32(s1 + np.int32(qs[r, o + 32 + j]) * np.int32(xq[t, o + 32 + j]))
                k = 2 * g
                acc += d[r, k] * xd[t, k] * np.float32(s0) + m[r, k] * xs[t, k]
                acc += d[r, k + 1] * xd[t, k + 1] * np.float32(s1) + m[r, k + 1] * xs[t, k + 1]
            y[t, r] = acc


@numba.njit(parallel=True, **_JIT)
def dot_i8_16(qs, d, m, xq, xd, xs, y):
    """int8 codes, a scale per 16 (Q6_K)."""
    for r in prange(qs.shape[0]):
        for t in range(xq.shape[0]):
            acc = np.float32(0.0)
            for g in range(qs.shape[1] // 64):
                o = g * 64
                s0 = np.int32(0)
                s1 = np.int32(0)
                s2 = np.int32(0)
                s3 = np.int32(0)
                for j in range(16):
                    s0 = np.int32(s0 + np.int32(qs[r, o + j]) * np.int32(xq[t, o + j]))
                    s1 = np.int32(s1 + np.int32(qs[r, o + 16 + j]) * np.int32(xq[t, o + 16 + j]))
                    s2 = np.int32(s2 + np.int32(qs[r, o + 32 + j]) * np.int32(xq[t, o + 32 + j]))
                    s3 = np.int32(s3 + np.int32(qs[r, o + 48 + j]) * np.int32(xq[t, o + 48 + j]))
                k = 4 * g
                acc += (d[r, k] * np.float32(s0) + d[r, k + 1] * np.float32(s1)) * xd[t, 2 * g]
                acc += (d[r, k + 2] * np.float32(s2) + d[r, k + 3] * np.float32(s3)) * xd[t, 2 * g + 1]
                acc += m[r, k] * xs[t, k] + m[r, k + 1] * xs[t, k + 1]
                acc += m[r, k + 2] * xs[t, k + 2] + m[r, k + 3] * xs[t, k + 3]
            y[t, r] = acc


@numba.njit(**_JIT)
def dequant_nib(qs, d, m, sub, rows, out):
    """out[i] = row rows[i] as float32 (n, n_pad); scales hoisted so the stores vectorize.
    Serial: the tiles feed BLAS, whose threads would fight numba's spinning ones."""
    for i in range(rows.shape[0]):
        r = rows[i]
        for g in range(qs.shape[1] // 32):
            o = g * 32
            if sub == 32:
                d0, m0, d1, m1 = d[r, 2 * g], m[r, 2 * g], d[r, 2 * g + 1], m[r, 2 * g + 1]
                for j in range(32):
                    b = qs[r, o + j]
                    out[i, 2 * o + j] = d0 * np.float32(b & 15) + m0
                    out[i, 2 * o + 32 + j] = d1 * np.float32(b >> 4) + m1
            else:
                k = 4 * g
                d0, d1, d2, d3 = d[r, k], d[r, k + 1], d[r, k + 2], d[r, k + 3]
                m0, m1, m2, m3 = m[r, k], m[r, k + 1], m[r, k + 2], m[r, k + 3]
                for j in range(16):
                    b0 = qs[r, o + j]
                    b1 = qs[r, o + 16 + j]
                    out[i, 2 * o + j] = d0 * np.float32(b0 & 15) + m0
                    out[i, 2 * o + 16 + j] = d1 * np.float32(b1 & 15) + m1
                    out[i, 2 * o + 32 + j] = d2 * np.float32(b0 >> 4) + m2
                    out[i, 2 * o + 48 + j] = d3 * np.float32(b1 >> 4) + m3


@numba.njit(**_JIT)
def dequant_i8(qs, d, m, sub, rows, out):
    for i in range(rows.shape[0]):
        r = rows[i]
        for g in range(qs.shape[1] // 64):
            o = g * 64
            if sub == 32:
                d0, m0, d1, m1 = d[r, 2 * g], m[r, 2 * g], d[r, 2 * g + 1], m[r, 2 * g + 1]
                for j in range(32):
                    out[i, o + j] = d0 * np.float32(qs[r, o + j]) + m0
                    out[i, o + 32 + j] = d1 * np.float32(qs[r, o + 32 + j]) + m1
            else:
                k = 4 * g
                d0, d1, d2, d3 = d[r, k], d[r, k + 1], d[r, k + 2], d[r, k + 3]
                m0, m1, m2, m3 = m[r, k], m[r, k + 1], m[r, k + 2], m[r, k + 3]
                for j in range(16):
                    out[i, o + j] = d0 * np.float32(qs[r, o + j]) + m0
                    out[i, o + 16 + j] = d1 * np.float32(qs[r, o + 16 + j]) + m1
                    out[i, o + 32 + j] = d2 * np.float32(qs[r, o + 32 + j]) + m2
                    out[i, o + 48 + j] = d3 * np.float32(qs[r, o + 48 + j]) + m3
