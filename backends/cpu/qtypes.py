"""Repacking GGUF weight blocks into the layouts the numba kernels in `matmul.py` read.

Every quantized type becomes one of two layouts, so a handful of kernels serve all of them:
  - "nib": 4-bit codes (0..15), two per byte, per 64 weights 32 bytes: the low nibble of byte j
    is weight j, the high nibble weight 32+j (Q4_K's own order; one widening load per 32).
  - "i8":  one int8 code per weight (Q8_0, and the 5- and 6-bit types, whose bit planes would
    cost more to unpack than the extra bytes cost to read).
Each sub-block (32 weights, or 16 for Q2_K/Q3_K/Q6_K) has a float32 scale `d` and offset `m`:
weight = d * code + m. Scales are float32 because numba cannot take float16 arrays.
"""

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType as T

from hearthlm.runtime.errors import UnsupportedModelError

from .kquants import KQUANT_UNPACKERS, f16_field

SUPPORTED_TYPES = frozenset(int(t) for t in (
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
))

FLOAT_TYPES = frozenset(int(t) for t in (T.F32, T.F16, T.BF16))


@dataclass(eq=False)
class PackedWeight:
    """A weight matrix in kernel layout. `shape` is (n_rows, n_cols) of the logical matrix."""

    ggml_type: int
    shape: tuple[int, int]
    layout: str                    # "f32", "nib" or "i8"
    sub: int = 0                   # weights per scale: 32 or 16 (0 for f32)
    w: np.ndarray | None = None    # f32: (n_rows, n_cols) float32
    qs: np.ndarray | None = None   # nib: (n_rows, n_pad // 2) uint8; i8: (n_rows, n_pad) int8
    d: np.ndarray | None = None    # (n_rows, n_pad // sub) float32 scale
    m: np.ndarray | None = None    # (n_rows, n_pad // sub) float32 offset

    @property
    def n_pad(self) -> int:
        """Columns after padding to whole 64-weight groups (pad codes and scales are zero)."""
        return self.shape[1] if self.layout == "f32" else self.d.shape[1] * self.sub

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w, self.qs, self.d, self.m) if a is not None)


def pack_weight(ggml_type: int, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Repack raw GGUF rows (n_rows, row_bytes) uint8, possibly a read-only memmap."""
    ggml_type = int(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        name = T(ggml_type).name if ggml_type in T._value2member_map_ else str(ggml_type)
        raise UnsupportedModelError(f"the CPU backend cannot run weights of type {name}")
    n_rows, n_cols = (int(s) for s in shape)
    raw = np.asarray(raw).reshape(n_rows, -1)
    if ggml_type in FLOAT_TYPES:
        return PackedWeight(ggml_type, (n_rows, n_cols), "f32", w=_to_f32(ggml_type, raw, n_cols))
    layout, sub, codes, d, m = _UNPACKERS[ggml_type](raw, n_rows, n_cols)
    return _pack_codes(ggml_type, (n_rows, n_cols), layout, sub, codes, d, m)


def _to_f32(ggml_type: int, raw: np.ndarray, n_cols: int) -> np.ndarray:
    if ggml_type == T.F32:
        # zero-copy view of the mmap when it is contiguous; BLAS reads it as is
        return np.ascontiguousarray(raw).view(np.float32).reshape(-1, n_cols)
    bits = np.ascontiguousarray(raw).view(np.uint16).reshape(-1, n_cols)
    if ggml_type == T.F16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)  # BF16 is the top half of f32


def _pack_codes(ggml_type, shape, layout, sub, codes, d, m) -> PackedWeight:
    """codes (n_rows, n_cols) uint8/int8, d and m (n_rows, n_cols // sub) -> padded kernel layout."""
    n_rows, n_cols = shape
    n_pad = -(-n_cols // 64) * 64
    if n_pad != n_cols:  # zero codes with zero scale contribute nothing
        codes = np.pad(codes, ((0, 0), (0, n_pad - n_cols)))
        d = np.pad(d, ((0, 0), (0, (n_pad - n_cols) // sub)))
        m = np.pad(m, ((0, 0), (0, (n_pad - n_cols) // sub)))
    if layout == "nib":
        c = codes.reshape(n_rows, n_pad // 64, 2, 32)
        qs = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).astype(np.uint8).reshape(n_rows, n_pad // 2)
    else:
        qs = codes.astype(np.int8)
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
    return PackedWeight(ggml_type, shape, layout, sub, qs=np.ascontiguousarray(qs), d=f32(d), m=f32(m))


def _blocks(raw, n_rows, n_cols, block_bytes):
    return raw.reshape(n_rows, n_cols // 32, block_bytes)  # (n_rows, n_blocks, block_bytes)


def _nibbles_32(qs):
    """(…, 16) bytes -> (…, 32) codes in ggml's order: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh):
    """(…, 4) bytes of a little-endian uint32 -> (…, 32) bits, bit i = weight i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 34)
    d = f16_field(b, 0)
    return "i8", 32, b[..., 2:].view(np.int8).reshape(n_rows, n_cols), d, np.zeros_like(d)


def _q4_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 18)
    d = f16_field(b, 0)
    return "nib", 32, _nibbles_32(b[..., 2:]).reshape(n_rows, n_cols), d, -8.0 * d


def _q4_1(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 20)
    return "nib", 32, _nibbles_32(b[..., 4:]).reshape(n_rows, n_cols), f16_field(b, 0), f16_field(b, 2)


def _q5_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 22)
    d = f16_field(b, 0)
    codes = _nibbles_32(b[..., 6:]) | (_high_bits_32(b[..., 2:6]) << 4)
    return "i8", 32, codes.reshape(n_rows, n_cols), d, -16.0 * d


def _q5_1(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 24)
    codes = _nibbles_32(b[..., 8:]) | (_high_bits_32(b[..., 4:8]) << 4)
    return "i8", 32, codes.reshape(n_rows, n_cols), f16_field(b, 0), f16_field(b, 2)


_UNPACKERS = {
    int(T.Q8_0): _q8_0, int(T.Q4_0): _q4_0, int(T.Q4_1): _q4_1,
    int(T.Q5_0): _q5_0, int(T.Q5_1): _q5_1, **KQUANT_UNPACKERS,
}
