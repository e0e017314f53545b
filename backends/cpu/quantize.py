"""Quantization on the CPU, behind matmul.py: activations to int8 blocks, and weights back to
float32 (dequantization, for BLAS tiles and embedding lookups; dot.py has
the integer dot products). Layouts are those of qtypes.py: weight = d*(code + c) + m, rows in blocks of 16 interleaved
by 64-weight group 4 weights at a time (see qtypes), d and m (block, sub-block, row in block), m a single
zero per sub-block (ms=0) for types without a minimum; K-quants' d and m are small integers times
their super-block's float16 in `sup` (sub_scale).
"""

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from .halfs import bits_as_f32, f32

_JIT = dict(cache=True, fastmath=True, nogil=True)


@numba.njit(cache=True, nogil=True)  # no fastmath: NaN and inf must be seen, and rint kept
def _quantize_row(x, xq, xd, xs, sub, t):
    """Per 32 columns: amax from the integer max of |x|'s bit patterns (the order of
    non-negative floats; inf and NaN sort above every finite value, so the same max says
    whether the block is finite), then int8 codes rint(x * 127 / amax): loops that vectorize."""
    n_cols = x.shape[1]
    xi = x.view(np.int32)
    for b in range(xd.shape[1]):
        c0 = b * 32
        c1 = min(c0 + 32, n_cols)
        abits = np.int32(0)
        for c in range(c0, c1):
            abits = max(abits, np.int32(xi[t, c] & np.int32(0x7FFFFFFF)))
        scale = bits_as_f32(abits) / np.float32(127.0)
        if abits >= np.int32(0x7F800000):  # a NaN or inf in x must reach y as NaN, not vanish in the cast
            xd[t, b] = np.float32(np.nan)
            for c in range(c0, c0 + 32):
                xq[t, c] = 0
            continue
        xd[t, b] = scale
        if scale > 0:
            inv = np.float32(1.0) / scale
            for c in range(c0, c1):
                xq[t, c] = np.int8(np.rint(x[t, c] * inv))
        else:
            for c in range(c0, c1):
                xq[t, c] = 0
        for c in range(max(c1, c0), c0 + 32):  # padding columns
            xq[t, c] = 0
    for k in range(xs.shape[1]):
        acc = np.int32(0)
        for j in range(sub):
            acc += np.int32(xq[t, k * sub + j])
        xs[t, k] = np.float32(acc) * xd[t, (k * sub) // 32]


@numba.njit(cache=True, nogil=True)
def _quantize_rows(x, xq, xd, xs, sub):
    for t in range(x.shape[0]):
        _quantize_row(x, xq, xd, xs, sub, t)


@numba.njit(cache=True, nogil=True, parallel=True)
def _quantize_rows_par(x, xq, xd, xs, sub):
    """Many tokens (batched decode, prefill): one token per task; the same per-token math."""
    for t in prange(x.shape[0]):
        _quantize_row(x, xq, xd, xs, sub, t)


def quantize_x(x, n_pad, sub):
    """x (n_tok, n_cols) f32 -> xq (n_tok, n_pad) int8, xd (n_tok, n_pad//32), xs (n_tok, n_pad//sub)."""
    n_tok = x.shape[0]
    xq = np.empty((n_tok, n_pad), dtype=np.int8)
    xd = np.empty((n_tok, n_pad // 32), dtype=np.float32)
    xs = np.empty((n_tok, n_pad // sub), dtype=np.float32)
    (_quantize_rows_par if n_tok >= 4 else _quantize_rows)(x, xq, xd, xs, sub)
    return xq, xd, xs


def sub_scale(a, sup, p, sub, b, k, i):
    """a[b, k, i] (a d or m array, qtypes) as float32; compiled code only (see the overload)."""
    raise NotImplementedError


@overload(sub_scale, inline="always")
def _sub_scale(a, sup, p, sub, b, k, i):
    if a.dtype in (types.int8, types.uint8):  # a K-quant's sc times plane p of its super-block's float16: exact
        def impl(a, sup, p, sub, b, k, i):
            return f32(sup[b, (k * sub) >> 8, p, i]) * np.float32(a[b, k, i])
    else:  # float32, or float16 bits
        def impl(a, sup, p, sub, b, k, i):
            return f32(a[b, k, i])
    return impl


@numba.njit(inline="always", **_JIT)
def scale(d, sup, sub, r, k):
    """d of sub-block k of row r."""
    return sub_scale(d, sup, 0, sub, r >> 4, k, r & 15)


@numba.njit(inline="always", **_JIT)
def offset(d, m, sup, ms, c, sub, r, k):
    """The additive part of sub-block k of row r: m + c*d."""
    return sub_scale(m, sup, 1, sub, (r >> 4) * ms, k, (r & 15) * ms) + c * scale(d, sup, sub, r, k)


@numba.njit(inline="always", **_JIT)
def nib_code(qs, r, g, w):
    """Code w (0..63) of group g of row r from a nibble layout (qtypes): byte b of row i in 64-byte
    load j holds weights 4j+b (low nibble) and 32+4j+b (high); "nib5" (40 bytes a row) adds each
    weight's fifth bit from the masks after the 512 nibble bytes, "nib6" (48) its top two from the
    2-bit planes there."""
    i, j, b = r & 15, (w & 31) >> 2, w & 3
    width = qs.shape[3]
    f = 64 * j + 4 * i + b
    byte = np.int32(qs[r >> 4, g, f // width, f % width])
    code = (byte >> 4) if w >= 32 else (byte & 15)
    if width == 40:
        f = 512 + 16 * j + 8 * (w >> 5) + ((4 * i + b) >> 3)
        code |= ((np.int32(qs[r >> 4, g, f // width, f % width]) >> ((4 * i + b) & 7)) & 1) << 4
    elif width == 48:
        v = 2 * j + (w >> 5)  # the nibble vector (load j's low or high nibbles)
        f = 512 + 64 * (v >> 2) + 4 * i + b
        code |= ((np.int32(qs[r >> 4, g, f // width, f % width]) >> (2 * (v & 3))) & 3) << 4
    return code


@numba.njit(**_JIT)
def dequant_nib(qs, d, m, sup, ms, c, sub, rows, out, values):
    """out[i] = row rows[i] as float32 (n, n_pad). Serial: the tiles feed BLAS, whose threads
    would fight numba's spinning ones. Codes of the nibble layouts (nib_code); `values[code]` is
    the code's value: the code itself, code - 32 ("nib6"), or a lookup layout's table."""
    for n in range(rows.shape[0]):
        r = rows[n]
        for g in range(qs.shape[1]):
            for e in range(64 // sub):
                k = g * (64 // sub) + e
                sc, of = scale(d, sup, sub, r, k), offset(d, m, sup, ms, c, sub, r, k)
                for w in range(e * sub, (e + 1) * sub):
                    out[n, g * 64 + w] = sc * values[nib_code(qs, r, g, w)] + of


@numba.njit(**_JIT)
def dequant_i8(qs, d, m, sup, ms, c, sub, rows, out):
    """As dequant_nib for int8 codes: qs[block, group, j, 4i+b] is row i's weight 4j+b."""
    for n in range(rows.shape[0]):
        r = rows[n]
        i = r & 15
        for g in range(qs.shape[1]):
            for e in range(64 // sub):  # a sub-block's scale and offset once, not per weight
                k = g * (64 // sub) + e
                sc, of = scale(d, sup, sub, r, k), offset(d, m, sup, ms, c, sub, r, k)
                for w in range(e * sub, (e + 1) * sub):
                    out[n, g * 64 + w] = sc * np.float32(qs[r >> 4, g, w >> 2, 4 * i + (w & 3)]) + of
