"""Unpacking the i-quants, IQ4/MXFP4 and the ternary TQ types into codes + per-sub-block scales.

Same contract as `kquants.py`: (layout, sub, codes, d, m=None, c) with weight = d * (code + c),
for `qtypes._pack_codes`: the existing "i8" and "nib" kernels run the grid and ternary types,
and IQ4_NL/IQ4_XS/MXFP4 keep their 4-bit codes in a lookup layout (LUTS).
Each weight equals `gguf.quants.dequantize` bitwise: d is computed in float32 with gguf's (and
ggml's) operation order, and codes hold the exact integer factor (grid value times sign).
"""

import functools

import numpy as np
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as T

from .kquants import QK_K, f16_field


def _blocks(raw, n_rows, n_cols, block, block_bytes):
    return raw.reshape(n_rows * (n_cols // block), block_bytes)  # (n_blocks, block_bytes)


def _words(b: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes (n, k) as little-endian words (n, k // itemsize); the copy aligns them."""
    return np.ascontiguousarray(b).view(dtype)


def _fields(x: np.ndarray, shifts, mask) -> np.ndarray:
    """(n, k) words -> (n, k * len(shifts)) bit fields, the shifts of each word adjacent."""
    s = np.array(shifts, dtype=x.dtype)
    return ((x[:, :, None] >> s) & mask).reshape(len(x), -1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(…, 16) bytes -> (…, 32): low nibbles first, then high (ggml's order)."""
    return np.concatenate([q & 0x0F, q >> 4], axis=-1)


@functools.cache
def _grid(name: str) -> np.ndarray:
    """gguf's float32 grid of an i-quant as int8 (entries, weights per entry)."""
    cls = getattr(gq, name)
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape)
    assert np.array_equal(g, np.trunc(g)) and np.abs(g).max() <= 127, name
    return g.astype(np.int8)


@functools.cache
def _ksigns() -> np.ndarray:
    """(128, 8) int8 of +-1: entry k of ksigns, bit j set -> weight j negated."""
    ks = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)[:, None]
    return 1 - 2 * np.unpackbits(ks, axis=1, bitorder="little").astype(np.int8)


def _sign_bits(b: np.ndarray) -> np.ndarray:
    """(n, k) bytes of sign bits -> (n, 8k) +-1, bit j of byte i = weight 8i + j."""
    return 1 - 2 * np.unpackbits(b, axis=-1, bitorder="little").astype(np.int8)


def _i8(sub, codes, d, n_rows, n_cols):
    codes = codes.astype(np.int8).reshape(n_rows, n_cols)
    return "i8", sub, codes, d.astype(np.float32, copy=False).reshape(n_rows, n_cols // sub), None, 0


# the lookup layouts (qtypes): 4-bit codes index these tables of int8 values; weight = d * table[code]
LUTS = {"iq4nl": tuple(gq.IQ4_NL.kvalues), "mxfp4": tuple(gq.MXFP4.kvalues)}


def _lut(layout, idx, d, n_rows, n_cols):
    return layout, 32, idx.astype(np.uint8).reshape(n_rows, n_cols), d.reshape(n_rows, n_cols // 32), None, 0


def _iq4_nl(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 32, 18)
    return _lut("iq4nl", _nibbles(b[:, 2:]), f16_field(b, 0), n_rows, n_cols)


def _iq4_xs(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 136)
    # 6-bit scales: low nibble of sub-block 2i / 2i+1 in byte i's low / high half, 2 high bits each
    lo = _fields(b[:, 4:8], (0, 4), 0x0F)
    hi = _fields(_words(b[:, 2:4], "<u2"), range(0, 16, 2), 3)
    ls = (lo | (hi << 4)).astype(np.int16) - 32
    dl = f16_field(b, 0)[:, None] * ls.astype(np.float32)
    return _lut("iq4nl", _nibbles(b[:, 8:].reshape(-1, 8, 16)), dl, n_rows, n_cols)


def _mxfp4(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 32, 17)
    return _lut("mxfp4", _nibbles(b[:, 1:]), gq.MXFP4.e8m0_to_fp32_half(b[:, 0]), n_rows, n_cols)


def _ternary(q, d, n_rows, n_cols):
    # codes q + 1 in 0..2 fit the 4-bit layout; one scale per 256, repeated per 32
    d = np.repeat(d[:, None], QK_K // 32, axis=1).reshape(n_rows, -1)
    return "nib", 32, q.astype(np.uint8).reshape(n_rows, n_cols), d, None, -1


def _tq1_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 54)
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:, None]
    # base-3 digits by fixed point: byte * 3^k wraps in uint8 (as ggml's uint8_t), digit = (q*3) >> 8
    q = np.concatenate([(b[:, None, 0:32] * pow3).reshape(-1, 160),
                        (b[:, None, 32:48] * pow3).reshape(-1, 80),
                        (b[:, None, 48:52] * pow3[:4]).reshape(-1, 16)], axis=1)
    return _ternary((q.astype(np.uint16) * 3) >> 8, f16_field(b, 52), n_rows, n_cols)


def _tq2_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 66)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    q = (b[:, :64].reshape(-1, 2, 1, 32) >> shifts) & 3  # (half, 2-bit plane, byte)
    return _ternary(q, f16_field(b, 64), n_rows, n_cols)


def _iq2_xxs(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 66)
    # per 32 weights two uint32: 4 grid indices (bytes), then 4 x 7-bit sign indices + 4-bit scale
    aux = _words(b[:, 2:], "<u4").reshape(-1, 8, 2)[:, :, 1]
    grid = _grid("IQ2_XXS")[b[:, 2:].reshape(-1, 8, 2, 4)[:, :, 0]]  # (n, 8, 4, 8)
    signs = _ksigns()[_fields(aux, (0, 7, 14, 21), 0x7F)].reshape(grid.shape)
    db = f16_field(b, 0)[:, None] * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
    return _i8(32, grid * signs, db, n_rows, n_cols)


def _iq2_xs(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 74)
    qs = _words(b[:, 2:66], "<u2")  # per 8 weights: 9-bit grid index, 7-bit sign index
    codes = _grid("IQ2_XS")[qs & 511] * _ksigns()[qs >> 9]
    sc = _fields(b[:, 66:74], (0, 4), 0x0F)
    db = f16_field(b, 0)[:, None] * (np.float32(0.5) + sc) * np.float32(0.25)
    return _i8(16, codes, db, n_rows, n_cols)


def _iq2_s(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 82)
    # 10-bit grid index: a byte of qs and 2 bits of qh; explicit sign bits
    idx = b[:, 2:34].astype(np.uint16) | (_fields(b[:, 66:74], (0, 2, 4, 6), 3).astype(np.uint16) << 8)
    codes = _grid("IQ2_S")[idx].reshape(-1, QK_K) * _sign_bits(b[:, 34:66])
    sc = _fields(b[:, 74:82], (0, 4), 0x0F)
    db = f16_field(b, 0)[:, None] * (np.float32(0.5) + sc) * np.float32(0.25)
    return _i8(16, codes, db, n_rows, n_cols)


def _iq3_xxs(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 98)
    aux = _words(b[:, 66:98], "<u4")  # per 32 weights: 4 x 7-bit sign indices + 4-bit scale
    grid = _grid("IQ3_XXS")[b[:, 2:66]].reshape(-1, 8, 4, 8)  # an index per 4 weights
    signs = _ksigns()[_fields(aux, (0, 7, 14, 21), 0x7F)].reshape(grid.shape)
    db = f16_field(b, 0)[:, None] * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    return _i8(32, grid * signs, db, n_rows, n_cols)


def _iq3_s(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 110)
    idx = b[:, 2:66].astype(np.uint16) | (_fields(b[:, 66:74], range(8), 1).astype(np.uint16) << 8)
    codes = _grid("IQ3_S")[idx].reshape(-1, QK_K) * _sign_bits(b[:, 74:106])
    db = f16_field(b, 0)[:, None] * (1 + 2 * _fields(b[:, 106:110], (0, 4), 0x0F))
    return _i8(32, codes, db, n_rows, n_cols)


# IQ1_S/IQ1_M weights are dl * (grid + delta), grid in {-1, 0, 1}, delta = +-1/8: as codes
# 8 * grid +- 1 with d = dl / 8. dl / 8 is exact (dl is far from float32's subnormals), so
# both products round the same real number once: bitwise equal.
def _iq1(grid, minus, dl, sub, n_rows, n_cols):
    codes = 8 * grid + np.where(minus, -1, 1).astype(np.int8)[..., None]
    return _i8(sub, codes, dl / np.float32(8), n_rows, n_cols)


def _iq1_s(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 50)
    qh = _words(b[:, 34:50], "<u2")  # per 32 weights: 4 x 3 high index bits, 3-bit scale, delta sign
    idx = b[:, 2:34].astype(np.uint16) | (_fields(qh, (0, 3, 6, 9), 7) << 8)
    grid = _grid("IQ1_S")[idx].reshape(-1, 8, 32)
    dl = f16_field(b, 0)[:, None] * (2 * ((qh >> 12) & 7) + 1)
    return _iq1(grid, (qh & 0x8000) != 0, dl, 32, n_rows, n_cols)


def _iq1_m(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, QK_K, 56)
    sc = _words(b[:, 48:56], "<u2")
    # the float16 d is the top nibbles of the 4 scale words; the rest is 16 x 3-bit scales
    d16 = np.bitwise_or.reduce((sc & 0xF000) >> np.array([12, 8, 4, 0], dtype=np.uint16), axis=1)
    d = d16.view(np.float16).astype(np.float32)[:, None]
    dl = d * (2 * _fields(sc, (0, 3, 6, 9), 7) + 1)
    qh = _fields(b[:, 32:48], (0, 4), 0x0F)  # per 8 weights: 3 high index bits, delta sign
    grid = _grid("IQ1_M")[b[:, :32].astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)]
    return _iq1(grid, (qh & 8) != 0, dl, 16, n_rows, n_cols)


IQUANT_UNPACKERS = {
    int(T.IQ4_NL): _iq4_nl, int(T.IQ4_XS): _iq4_xs, int(T.MXFP4): _mxfp4,
    int(T.TQ1_0): _tq1_0, int(T.TQ2_0): _tq2_0,
    int(T.IQ2_XXS): _iq2_xxs, int(T.IQ2_XS): _iq2_xs, int(T.IQ2_S): _iq2_s,
    int(T.IQ3_XXS): _iq3_xxs, int(T.IQ3_S): _iq3_s,
    int(T.IQ1_S): _iq1_s, int(T.IQ1_M): _iq1_m,
}
