"""Unpacking K-quant super-blocks (256 weights) into codes + per-sub-block scale and offset.

Block formats follow ggml-common.h (block_q2_K ... block_q6_K); each unpacker returns
(layout, sub, codes (n_rows, n_cols), d, m (or None), c) with weight = d * (code + c) + m, for
`qtypes._pack_codes`. d and m are kept as the file has them, pairs (D, sc): D the super-block's
float16 (bits, uint16, (n_rows, n_cols // 256)) and sc a small integer per sub-block (uint8 or
int8, (n_rows, n_cols // sub)); the kernels form float32(D) * float32(sc), exact in float32.
"""

import numpy as np
from gguf.constants import GGMLQuantizationType as T

QK_K = 256


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as float32 (…,)."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _f16_bits(blocks: np.ndarray, offset: int, negate: bool = False) -> np.ndarray:
    """The float16 at byte `offset` of every super-block as uint16 bits (n,); `negate`: its
    negative (the sign bit flipped: exact), for the mins, which are subtracted."""
    bits = np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.uint16)[..., 0]
    return bits ^ np.uint16(0x8000) if negate else bits


def _super_blocks(raw, n_rows, n_cols, block_bytes):
    return raw.reshape(n_rows * (n_cols // QK_K), block_bytes)  # (n_super, block_bytes)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (n, 8) each (get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _bit_planes(qh: np.ndarray, n_planes: int, bits: int) -> np.ndarray:
    """(n, 32) bytes holding `n_planes` fields of `bits` bits -> (n, n_planes, 32)."""
    shifts = np.arange(n_planes, dtype=np.uint8)[None, :, None] * bits
    return (qh[:, None, :] >> shifts) & ((1 << bits) - 1)


def _q2_k(raw, n_rows, n_cols):
    b = _super_blocks(raw, n_rows, n_cols, 84)
    sc = b[:, 0:16]
    # 64 bytes = 2 halves of 32; each byte holds 4 two-bit fields -> 8 runs of 32 weights
    q = _bit_planes(b[:, 16:80].reshape(-1, 32), 4, 2).reshape(-1, QK_K)
    codes = q.reshape(n_rows, n_cols)
    scale = (_f16_bits(b, 80).reshape(n_rows, -1), (sc & 0x0F).reshape(n_rows, -1))
    offset = (_f16_bits(b, 82, negate=True).reshape(n_rows, -1), (sc >> 4).reshape(n_rows, -1))
    return "nib", 16, codes, scale, offset, 0


def _q3_k(raw, n_rows, n_cols):
    b = _super_blocks(raw, n_rows, n_cols, 110)
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = _bit_planes(qs.reshape(-1, 32), 4, 2).reshape(-1, QK_K)
    high = _bit_planes(hmask, 8, 1).reshape(-1, QK_K)
    # a set hmask bit means no -4: code = low + 4*high lies in 0..7, weight = d*sc*(code - 4)
    codes = (low | (high << 2)).reshape(n_rows, n_cols)
    lo = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    hi = _bit_planes(s[:, 8:12], 4, 2).reshape(-1, 16)
    sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    return "nib", 16, codes, (_f16_bits(b, 108).reshape(n_rows, -1), sc.reshape(n_rows, -1)), None, -4


def _d_dmin(b, sc, mn, n_rows):
    """Q4_K/Q5_K's (D, sc) and (-Dmin, mn): d at bytes 0-1 of a super-block, dmin at 2-3."""
    return ((_f16_bits(b, 0).reshape(n_rows, -1), sc.reshape(n_rows, -1)),
            (_f16_bits(b, 2, negate=True).reshape(n_rows, -1), mn.reshape(n_rows, -1)))


def _q4_k(raw, n_rows, n_cols):
    b = _super_blocks(raw, n_rows, n_cols, 144)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n_rows, n_cols)
    return "nib", 32, codes, *_d_dmin(b, sc, mn, n_rows), 0


def _q5_k(raw, n_rows, n_cols):
    b = _super_blocks(raw, n_rows, n_cols, 176)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = _bit_planes(b[:, 16:48], 8, 1)  # bit j of qh[l] is the 5th bit of sub-block j, weight l
    codes = (low | (high << 4)).reshape(n_rows, n_cols)
    return "nib5", 32, codes, *_d_dmin(b, sc, mn, n_rows), 0


def _q6_k(raw, n_rows, n_cols):
    b = _super_blocks(raw, n_rows, n_cols, 210)
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8)
    # two halves of 128 weights: ql 64 bytes (low, high nibble), qh 32 bytes (4 two-bit fields)
    low = ql.reshape(-1, 2, 1, 64)
    low = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = _bit_planes(qh.reshape(-1, 32), 4, 2).reshape(-1, 2, 4, 32)
    codes = (low | (high << 4)).reshape(n_rows, n_cols)  # 0..63: the value is code - 32 ("nib6", qtypes)
    return "nib6", 16, codes, (_f16_bits(b, 208).reshape(n_rows, -1), sc.reshape(n_rows, -1)), None, 0


KQUANT_UNPACKERS = {
    int(T.Q2_K): _q2_k, int(T.Q3_K): _q3_k, int(T.Q4_K): _q4_k,
    int(T.Q5_K): _q5_k, int(T.Q6_K): _q6_k,
}
