"""The KV cache's rows for the numba kernels (core.kv_types). A cache is float32, float16 (its
uint16 bits: halfs), or a quantized type's blocks as bytes (uint8): which blocks is `kind`, the
type's ggml id, that the backend reads from the CACHE node when it binds a kernel. Rows are
quantized on write as ggml-quants.c's quantize_row_*_ref, bit for bit (core.kv_types' numpy
reference, and gguf.quants, are the tests' oracles), and read back one head's row at a time into
a small float buffer inside attention: no dequantized copy of the cache. load_row / store_row
dispatch on the row's dtype when a caller compiles (overloads) and, for blocks, on `kind` at run
time (one branch per row), so one kernel serves every type. `fwht` is the Hadamard rotation of
the "+rot" types (core.kv_types.rotate), in place."""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from .halfs import f32, half_bits

_JIT = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")
# bit-exact with the reference: no reassociation, contraction or reciprocal approximations
_EXACT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy")

# kinds: ggml's type ids (core.kv_types' records' ggml_type)
F32, F16, Q4_0, Q5_0, Q5_1, Q8_0, IQ4_NL = 0, 1, 2, 6, 7, 8, 20
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@numba.njit(inline="always", **_JIT)
def _half_at(row, o):
    """The float16 at bytes o, o+1 of a block row, widened."""
    return f32(np.uint16((np.int32(row[o]) & 0xFF) | ((np.int32(row[o + 1]) & 0xFF) << 8)))


@numba.njit(inline="always", **_EXACT)
def _put_half(row, o, v):
    h = np.int32(half_bits(np.float32(v)))
    row[o] = h & 0xFF
    row[o + 1] = (h >> 8) & 0xFF


@numba.njit(inline="always", **_EXACT)
def _signed_max(x, o):
    """The value of largest magnitude of x[o:o+32], the first of ties."""
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(32):
        v = x[o + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return mx


@numba.njit(inline="always", **_EXACT)
def _inv(d):
    return np.float32(1.0) / d if d != 0 else np.float32(0.0)


@numba.njit(**_EXACT)
def quantize_q8_0(x, row):
    """x (d,) float32 -> row (d // 32 * 34,) bytes {f16 d; i8 qs[32]}: per block amax / 127 as the
    scale, then round-half-away(x / d) (roundf, as gguf.quants' np_roundf)."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[32 * b + j]))
        d = amax / np.float32(127.0)
        inv = _inv(d)
        o = 34 * b
        _put_half(row, o, d)
        for j in range(32):
            v = x[32 * b + j] * inv
            a = abs(v)
            fl = np.floor(a)
            q = fl + np.floor(np.float32(2.0) * (a - fl))
            row[o + 2 + j] = np.int32(-q if v < 0 else q) & 0xFF


@numba.njit(**_EXACT)
def quantize_q4_0(x, row):
    """x (d,) float32 -> row (d // 32 * 18,) {f16 d; u8 qs[16]}: d = (the value of largest magnitude)
    / -8, codes min(15, trunc(x / d + 8.5)); value j < 16 in the low nibble of byte j, 16 + j the high."""
    for b in range(x.shape[0] // 32):
        d = _signed_max(x, 32 * b) / np.float32(-8.0)
        inv = _inv(d)
        o = 18 * b
        _put_half(row, o, d)
        for j in range(16):
            lo = min(15, np.int32(x[32 * b + j] * inv + np.float32(8.5)))
            hi = min(15, np.int32(x[32 * b + 16 + j] * inv + np.float32(8.5)))
            row[o + 2 + j] = lo | (hi << 4)


@numba.njit(inline="always", **_EXACT)
def _put_q5(row, o, lo, hi, j, qh):
    """Codes of values j and 16 + j (0..31): their low nibbles at byte o + j, bit 4 into qh."""
    row[o + j] = (lo & 0xF) | ((hi & 0xF) << 4)
    return qh | (np.uint32((lo >> 4) & 1) << np.uint32(j)) | (np.uint32((hi >> 4) & 1) << np.uint32(j + 16))


@numba.njit(inline="always", **_EXACT)
def _put_u32(row, o, v):
    for i in range(4):
        row[o + i] = np.int32((v >> np.uint32(8 * i)) & np.uint32(0xFF))


@numba.njit(**_EXACT)
def quantize_q5_0(x, row):
    """x (d,) float32 -> row (d // 32 * 22,) {f16 d; u8 qh[4]; u8 qs[16]}: d = (the value of largest
    magnitude) / -16, codes min(31, trunc(x / d + 16.5)); bit 4 of code j is bit j of qh (little-endian)."""
    for b in range(x.shape[0] // 32):
        d = _signed_max(x, 32 * b) / np.float32(-16.0)
        inv = _inv(d)
        o = 22 * b
        _put_half(row, o, d)
        qh = np.uint32(0)
        for j in range(16):
            lo = min(31, np.int32(x[32 * b + j] * inv + np.float32(16.5)))
            hi = min(31, np.int32(x[32 * b + 16 + j] * inv + np.float32(16.5)))
            qh = _put_q5(row, o + 6, lo, hi, j, qh)
        _put_u32(row, o + 2, qh)


@numba.njit(**_EXACT)
def quantize_q5_1(x, row):
    """x (d,) float32 -> row (d // 32 * 24,) {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: m the block's min,
    d = (max - min) / 31, codes trunc((x - min) / d + 0.5)."""
    for b in range(x.shape[0] // 32):
        lo_v = np.float32(np.inf)
        hi_v = np.float32(-np.inf)
        for j in range(32):
            v = x[32 * b + j]
            if v < lo_v:
                lo_v = v
            if v > hi_v:
                hi_v = v
        d = (hi_v - lo_v) / np.float32(31.0)
        inv = _inv(d)
        o = 24 * b
        _put_half(row, o, d)
        _put_half(row, o + 2, lo_v)
        qh = np.uint32(0)
        for j in range(16):
            lo = np.int32((x[32 * b + j] - lo_v) * inv + np.float32(0.5)) & 31
            hi = np.int32((x[32 * b + 16 + j] - lo_v) * inv + np.float32(0.5)) & 31
            qh = _put_q5(row, o + 8, lo, hi, j, qh)
        _put_u32(row, o + 4, qh)


@numba.njit(inline="always", **_EXACT)
def _iq4_index(al):
    """ggml's best_index_int8 over the iq4_nl table: the nearest value's index (the lower of a tie's)."""
    if al <= _IQ4NL[0]:
        return 0
    if al >= _IQ4NL[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if al < _IQ4NL[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if al - _IQ4NL[mu - 1] < _IQ4NL[mu] - al else mu


@numba.njit(**_EXACT)
def quantize_iq4_nl(x, row):
    """x (d,) float32 -> row (d // 32 * 18,) {f16 d; u8 qs[16]} (quantize_row_iq4_nl_ref): codes nearest
    x / d0 in the non-linear table at d0 = (the value of largest magnitude) / -127, then d the
    least-squares scale of those codes weighted by x^2 (float32 sums in order). An all-zero block
    (amax < 1e-15): d 0, codes 0."""
    for b in range(x.shape[0] // 32):
        o = 18 * b
        mx = _signed_max(x, 32 * b)
        for j in range(16):
            row[o + 2 + j] = 0
        if abs(mx) < np.float32(1e-15):
            _put_half(row, o, np.float32(0.0))
            continue
        inv = np.float32(1.0) / (mx / _IQ4NL[0])
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for j in range(32):
            v = x[32 * b + j]
            k = _iq4_index(inv * v)
            q = _IQ4NL[k]
            w = v * v
            sumqx += w * q * v
            sumq2 += w * q * q
            row[o + 2 + (j & 15)] |= k << (4 * (j >> 4))
        _put_half(row, o, sumqx / sumq2 if sumq2 > 0 else np.float32(0.0))


# ---- reads: a row's blocks -> float32 values ----

@numba.njit(inline="always", **_JIT)
def _load_q8_0(row, out):
    for b in range(out.shape[0] // 32):
        d = _half_at(row, 34 * b)
        for j in range(32):
            out[32 * b + j] = d * np.float32(np.int8(row[34 * b + 2 + j]))  # the byte as int8


@numba.njit(inline="always", **_JIT)
def _load_q4_0(row, out):
    for b in range(out.shape[0] // 32):
        d = _half_at(row, 18 * b)
        for j in range(16):
            q = np.int32(row[18 * b + 2 + j])
            out[32 * b + j] = d * np.float32((q & 0xF) - 8)
            out[32 * b + 16 + j] = d * np.float32((q >> 4) - 8)


@numba.njit(inline="always", **_JIT)
def _qh_at(row, o):
    return (np.uint32(row[o]) | (np.uint32(row[o + 1]) << np.uint32(8)) | (np.uint32(row[o + 2]) << np.uint32(16))
            | (np.uint32(row[o + 3]) << np.uint32(24)))


@numba.njit(inline="always", **_JIT)
def _load_q5(row, out, nbytes, has_min):
    """q5_0 ((code - 16) d) or q5_1 (code d + m): codes are nibble | bit j of qh << 4."""
    for b in range(out.shape[0] // 32):
        o = nbytes * b
        d = _half_at(row, o)
        m = _half_at(row, o + 2) if has_min else np.float32(-16.0) * d
        o2 = o + 4 if has_min else o + 2
        qh = _qh_at(row, o2)
        for j in range(16):
            q = np.int32(row[o2 + 4 + j])
            lo = (q & 0xF) | (np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4)
            hi = (q >> 4) | (np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4)
            if has_min:
                out[32 * b + j] = d * np.float32(lo) + m
                out[32 * b + 16 + j] = d * np.float32(hi) + m
            else:  # as ggml: the code less 16, times d
                out[32 * b + j] = d * np.float32(lo - 16)
                out[32 * b + 16 + j] = d * np.float32(hi - 16)


@numba.njit(inline="always", **_JIT)
def _load_iq4_nl(row, out):
    for b in range(out.shape[0] // 32):
        d = _half_at(row, 18 * b)
        for j in range(16):
            q = np.int32(row[18 * b + 2 + j])
            out[32 * b + j] = d * _IQ4NL[q & 0xF]
            out[32 * b + 16 + j] = d * _IQ4NL[q >> 4]


def load_row(row, out, kind):
    """out (d,) float32 = a cache row's values (any cache dtype; blocks of type `kind`); compiled code only."""
    raise NotImplementedError


def store_row(x, row, kind):
    """A cache row (any cache dtype; blocks of type `kind`) = x (d,) float32, quantized or narrowed;
    compiled code only."""
    raise NotImplementedError


@overload(load_row, inline="always")
def _load_row(row, out, kind):
    if row.dtype == types.uint8:
        def impl(row, out, kind):
            if kind == Q8_0:
                _load_q8_0(row, out)
            elif kind == Q4_0:
                _load_q4_0(row, out)
            elif kind == Q5_0:
                _load_q5(row, out, 22, False)
            elif kind == Q5_1:
                _load_q5(row, out, 24, True)
            else:
                _load_iq4_nl(row, out)
    else:
        def impl(row, out, kind):
            for j in range(out.shape[0]):
                out[j] = f32(row[j])
    return impl


@overload(store_row, inline="always")
def _store_row(x, row, kind):
    if row.dtype == types.uint8:
        def impl(x, row, kind):
            if kind == Q8_0:
                quantize_q8_0(x, row)
            elif kind == Q4_0:
                quantize_q4_0(x, row)
            elif kind == Q5_0:
                quantize_q5_0(x, row)
            elif kind == Q5_1:
                quantize_q5_1(x, row)
            else:
                quantize_iq4_nl(x, row)
    elif row.dtype == types.uint16:  # float16 bits: the CPU's conversion, or bit arithmetic without one
        def impl(x, row, kind):
            for j in range(x.shape[0]):
                row[j] = half_bits(np.float32(x[j]))
    else:
        def impl(x, row, kind):
            for j in range(x.shape[0]):
                row[j] = x[j]
    return impl


@numba.njit(inline="always", **_JIT)
def fwht(x, n):
    """x (d,) float32 in place: each run of n values (a power of two) times the orthonormal
    Walsh-Hadamard matrix H_n (Sylvester's order: core.kv_types.hadamard), a butterfly per level."""
    s = np.float32(1.0 / math.sqrt(n))
    for c in range(0, x.shape[0], n):
        h = 1
        while h < n:
            for i in range(c, c + n, 2 * h):
                for j in range(i, i + h):
                    a = x[j]
                    b = x[j + h]
                    x[j] = a + b
                    x[j + h] = a - b
            h *= 2
        for j in range(c, c + n):
            x[j] *= s


@numba.njit(inline="always", **_JIT)
def put_row(x, row, kind, rot, tmp):
    """store_row of x rotated by H_rot first (rot 0: as it is); tmp (d,) float32 scratch."""
    if rot > 0:
        for j in range(x.shape[0]):
            tmp[j] = x[j]
        fwht(tmp, rot)
        store_row(tmp, row, kind)
    else:
        store_row(x, row, kind)


@numba.njit(parallel=True, **_JIT)
def dequant_rows(cache, slots, kind, rot, out):
    """out (n, h, d) float32 = the values of cache rows slots (n,) (rotated back where rot): the
    unfused path's gather and an encoder's keys, where a float copy is made anyway."""
    for i in prange(slots.shape[0]):
        for h in range(cache.shape[1]):
            load_row(cache[slots[i], h], out[i, h], kind)
            if rot > 0:
                fwht(out[i, h], rot)
