"""Integer dot products of packed weight rows with int16-quantized activations (decode path).

Sub-block k of a row holds weight = d*(code + c) + m; activations are x = xd*xq per 32, and
xs = xd*sum(xq) per sub-block, so the sub-block's share of the dot product is
d*xd*sum(code*xq) + (m + c*d)*xs: integers inside, one float multiply-add per sub-block.
int16 activations (not ggml's int8) keep the error ~1e-9 relative: one row's result
stays within test tolerance, and the int32 sums cannot overflow (32 * 127 * 32767 < 2**31).

The inner loops have constant trip counts and several independent sums on purpose: LLVM
then vectorizes them whole (vpmovzxbw + vpmaddwd/vpdpwssd); a single 32-long sum gets a
vector loop whose step (64) never fits, and runs in the scalar remainder. The int32 casts
keep the sums narrow: numba widens integer arithmetic to int64 otherwise.
"""

import numba
import numpy as np
from numba import prange

# no fastmath: the float combination must be plain IEEE operations in a fixed order, the same as
# dot_multi's (batch invariance; the integer sums vectorize without it)
_JIT = dict(cache=True, nogil=True, parallel=True)


@numba.njit(inline="always", cache=True, nogil=True)
def _term(d, m, ms, c, r, k, xdv, s, xsv):
    """Sub-block k's share of the dot product, exactly as dot_multi._combine computes it."""
    return d[r, k] * xdv * np.float32(s) + (m[r * ms, k] + c * d[r, k]) * xsv


@numba.njit(**_JIT)
def dot_nib32(qs, d, m, ms, c, xq, xd, xs, y):
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
                acc = acc + _term(d, m, ms, c, r, k, xd[t, k], s0, xs[t, k])
                acc = acc + _term(d, m, ms, c, r, k + 1, xd[t, k + 1], s1, xs[t, k + 1])
            y[t, r] = acc


@numba.njit(**_JIT)
def dot_nib16(qs, d, m, ms, c, xq, xd, xs, y):
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
                acc = _sums16(acc, d, m, ms, c, r, 4 * g, xd[t, 2 * g], xd[t, 2 * g + 1], xs, t, s0, s1, s2, s3)
            y[t, r] = acc


@numba.njit(**_JIT)
def dot_i8_32(qs, d, m, ms, c, xq, xd, xs, y):
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
                acc = acc + _term(d, m, ms, c, r, k, xd[t, k], s0, xs[t, k])
                acc = acc + _term(d, m, ms, c, r, k + 1, xd[t, k + 1], s1, xs[t, k + 1])
            y[t, r] = acc


@numba.njit(**_JIT)
def dot_i8_16(qs, d, m, ms, c, xq, xd, xs, y):
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
                acc = _sums16(acc, d, m, ms, c, r, 4 * g, xd[t, 2 * g], xd[t, 2 * g + 1], xs, t, s0, s1, s2, s3)
            y[t, r] = acc


@numba.njit(inline="always", cache=True, nogil=True)
def _sums16(acc, d, m, ms, c, r, k, xd0, xd1, xs, t, s0, s1, s2, s3):
    """Four 16-weight sub-blocks k..k+3 (the first two under activation scale xd0), one at a time."""
    acc = acc + _term(d, m, ms, c, r, k, xd0, s0, xs[t, k])
    acc = acc + _term(d, m, ms, c, r, k + 1, xd0, s1, xs[t, k + 1])
    acc = acc + _term(d, m, ms, c, r, k + 2, xd1, s2, xs[t, k + 2])
    return acc + _term(d, m, ms, c, r, k + 3, xd1, s3, xs[t, k + 3])
