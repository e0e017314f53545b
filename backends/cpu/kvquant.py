"""The quantized KV cache's blocks for the numba kernels (core.kv_types: ggml's q8_0 and q4_0,
32 values along head_dim; an int8 cache holds q8_0, a uint8 one q4_0). Rows are quantized on
write as ggml-quants.c's quantize_row_q8_0_ref / quantize_row_q4_0_ref, bit for bit (gguf.quants
is the test's oracle), and read back one head's row at a time into a small float buffer inside
attention: no dequantized copy of the cache. The generic helpers dispatch on the cache's dtype
when a caller compiles (overloads), so one kernel serves float, float16 and quantized caches."""
from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from .halfs import f32, half_bits, like

_JIT = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")
# bit-exact with the reference: no reassociation or reciprocal approximations
_EXACT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy")


@numba.njit(inline="always", **_JIT)
def _half_at(row, o):
    """The float16 scale at bytes o, o+1 of a block row (int8 or uint8), widened."""
    return f32(np.uint16((np.int32(row[o]) & 0xFF) | ((np.int32(row[o + 1]) & 0xFF) << 8)))


@numba.njit(inline="always", **_EXACT)
def _put_half(row, o, v):
    h = np.int32(half_bits(np.float32(v)))
    row[o] = h & 0xFF  # stored as the row's own byte type: the bit pattern is kept
    row[o + 1] = (h >> 8) & 0xFF


@numba.njit(**_EXACT)
def quantize_q8_0(x, row):
    """x (d,) float32 -> row (d // 32 * 34,) int8: per block amax / 127 as the f16 scale, then
    round-half-away(x / d) (roundf, as gguf.quants' np_roundf)."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[32 * b + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = 34 * b
        _put_half(row, o, d)
        for j in range(32):
            v = x[32 * b + j] * inv
            a = abs(v)
            fl = np.floor(a)
            q = fl + np.floor(np.float32(2.0) * (a - fl))
            row[o + 2 + j] = np.int32(-q if v < 0 else q)


@numba.njit(**_EXACT)
def quantize_q4_0(x, row):
    """x (d,) float32 -> row (d // 32 * 18,) uint8: d = (the value of largest magnitude) / -8,
    codes min(15, trunc(x / d + 8.5)); value j < 16 in the low nibble of byte j, 16 + j the high."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            v = x[32 * b + j]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        d = mx / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = 18 * b
        _put_half(row, o, d)
        for j in range(16):
            lo = min(15, np.int32(x[32 * b + j] * inv + np.float32(8.5)))
            hi = min(15, np.int32(x[32 * b + 16 + j] * inv + np.float32(8.5)))
            row[o + 2 + j] = lo | (hi << 4)


def load_row(row, out):
    """out (d,) float32 = a cache row's values (any cache dtype); compiled code only."""
    raise NotImplementedError


def store_row(x, row):
    """A cache row (any cache dtype) = x (d,) float32, quantized or narrowed; compiled code only."""
    raise NotImplementedError


@overload(load_row, inline="always")
def _load_row(row, out):
    if row.dtype == types.int8:
        def impl(row, out):
            for b in range(out.shape[0] // 32):
                d = _half_at(row, 34 * b)
                for j in range(32):
                    out[32 * b + j] = d * np.float32(row[34 * b + 2 + j])
    elif row.dtype == types.uint8:
        def impl(row, out):
            for b in range(out.shape[0] // 32):
                d = _half_at(row, 18 * b)
                for j in range(16):
                    q = np.int32(row[18 * b + 2 + j])
                    out[32 * b + j] = d * np.float32((q & 0xF) - 8)
                    out[32 * b + 16 + j] = d * np.float32((q >> 4) - 8)
    else:
        def impl(row, out):
            for j in range(out.shape[0]):
                out[j] = f32(row[j])
    return impl


@overload(store_row, inline="always")
def _store_row(x, row):
    if row.dtype == types.int8:
        return lambda x, row: quantize_q8_0(x, row)
    if row.dtype == types.uint8:
        return lambda x, row: quantize_q4_0(x, row)

    def impl(x, row):
        for j in range(x.shape[0]):
            row[j] = like(row, x[j])
    return impl


@numba.njit(parallel=True, **_JIT)
def dequant_rows(cache, slots, out):
    """out (n, h, d) float32 = the values of cache rows slots (n,): the unfused path's gather
    and an encoder's keys, where a float copy is made anyway."""
    for i in prange(slots.shape[0]):
        for h in range(cache.shape[1]):
            load_row(cache[slots[i], h], out[i, h])
