"""Repacking GGUF weight blocks into the layouts the numba kernels in `matmul.py` read.

F32 stays float32 (a zero-copy view of the file when it can), F16 and BF16 stay 2-byte bit
patterns (layout "half", in `qs`; halfs.py widens them). Every quantized type becomes one of
a few layouts, so a handful of kernels serve all of them:
  - "nib": 4-bit codes (0..15), two per byte, per 64 weights 32 bytes: the low nibble of byte j
    is weight j, the high nibble weight 32+j (Q4_K's own order; one widening load per 32).
  - "nib5": 5-bit codes (0..31, Q5_0/Q5_1/Q5_K): per 64 weights the 32 bytes of "nib" for the
    low 4 bits, then 8 bytes whose bit j (little-endian) is weight j's fifth bit: 40 bytes.
  - "nib6": Q6_K's 6-bit codes u = s + 32 (s = -32..31 is the weight's value): per 64 weights the
    32 bytes of "nib" for the low 4 bits, then 16 bytes of their top two bits: 48 bytes. The
    kernels take s as the "i8" layout does (the same integers, so the same results; over 4 tokens
    from an int8 copy of each block of rows, unpacked once).
  - "i8":  one int8 code per weight (Q8_0; the IQ types' grid values and IQ4/MXFP4's lookup
    values, iquants.py: exact, at up to 4x their bytes, until they get kernels of their own).
  TQ1_0/TQ2_0's ternary codes go in "nib".
  - "iq4nl", "mxfp4": "nib" bytes whose codes index the type's table of 16 int8 values (LUTS),
    looked up in registers by the kernels (vpshufb): IQ4_NL, IQ4_XS and MXFP4 at 4 bits a weight.
Rows go in blocks of ROWS = 16, and within a block and group of 64 weights, 4 weights at a
time: one 64-byte load is 4 consecutive weights of each of the 16 rows, a row a 32-bit lane
(dot.py: each vpdpbusd then adds into a lane per row, with no shuffling across lanes). "i8":
qs[rb, g] holds, for j < 16, row i's weights 4j..4j+3 at bytes 64j + 4i; "nib": for j < 8, byte
64j + 4i + b holds row i's weight 4j+b (low nibble) and 32+4j+b (high); "nib5": those 512 bytes,
then per j a 64-bit mask of the low weights' fifth bits (bit 4i+b) and one of the high weights';
"nib6": those 512 bytes, then 4 x 64 bytes of 2-bit fields: the 16 vectors of 64 nibbles (load
j's low ones v = 2j, its high ones v = 2j+1) get their top bits from bits 2(v % 4) of byte 4i+b of
64-byte plane v // 4. qs's shape, (blocks, groups, 16, 64 / 32 / 40 / 48 bytes), is the bytes'
count, not rows: a block's group is one stream of 1024 / 512 / 640 / 768 bytes. Reading 16 rows
side by side from a row-major matrix would be 16 streams, which the hardware prefetcher does not
follow (measured: the same kernel read SmolLM2's weights at 16 GB/s that way, where one stream
reaches ~50).
Each sub-block (32 weights, or 16 for Q2_K/Q3_K/Q6_K) has a scale `d`, and types with a
stored minimum an offset `m`: weight = d * (code + c) + m, with c a per-type constant (-8 for
Q4_0's unsigned nibbles). d and m are (row block, sub-block, 16 rows): the kernels read a
block's 16 scales of a sub-block as one vector. Types without a minimum keep a single zero of
`m` per sub-block (step ms = 0) instead of one per row: that is a quarter of Q8_0's bytes.
Scales that are float16 in the file stay float16, as uint16 bits (numba has no float16 type; the
kernels widen them, exactly); IQ types' computed ones are float32. K-quants keep the file's
split: d and m hold the small integer sc per sub-block (uint8, or int8 for Q3_K/Q6_K), and `sup`
(row block, super-block of 256, plane, 16 rows) the super-block's float16 D (plane 0) and -Dmin
(plane 1), as uint16 bits; the kernels form d = float32(D) * float32(sc) (m likewise), exact in
float32 (11 significant bits times at most 8), so the same float32 scales as a stored copy, at
under a third of the bytes (Q4_K: 4.6 bits a weight, not 6). Other types' `sup` is a one-element
dummy: the kernels specialize on d's dtype. Rows are padded to whole blocks (zero codes and
scales); the kernels never write the padding rows out.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.core.errors import UnsupportedModelError
from hearthlm.core.weights import release_pages

from .iquants import IQUANT_UNPACKERS, LUTS
from .kquants import KQUANT_UNPACKERS, f16_field

SUPPORTED_TYPES = frozenset(int(t) for t in (
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.TQ1_0, T.TQ2_0, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
))

LAYOUT_VERSION = 5  # of everything below: bump it when a layout changes (cached packed weights are rebuilt)
ROWS = 16  # rows per block of the quantized layouts
PACK_ROWS = 4096  # rows unpacked at a time (a multiple of ROWS)
KINDS = {("nib", 32): 0, ("nib", 16): 1, ("i8", 32): 2, ("i8", 16): 3, ("nib5", 32): 4,  # dot.py's kernel families
         ("iq4nl", 32): 5, ("mxfp4", 32): 6, ("nib6", 16): 7}

HALF_SCALE_TYPES = frozenset(int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.TQ1_0, T.TQ2_0))

FLOAT_TYPES = frozenset(int(t) for t in (T.F32, T.F16, T.BF16))


@dataclass(eq=False)
class PackedWeight:
    """A weight matrix in kernel layout. `shape` is (n_rows, n_cols) of the logical matrix."""

    ggml_type: int
    shape: tuple[int, int]
    layout: str                    # "f32", "half", "nib", "nib5", "nib6", "i8", or a lookup layout ("iq4nl", "mxfp4")
    sub: int = 0                   # weights per scale: 32 or 16 (0 for f32)
    w: np.ndarray | None = None    # f32: (n_rows, n_cols) float32
    qs: np.ndarray | None = None   # nib: (n_blocks, n_pad // 64, ROWS, 32) uint8; nib5, nib6: (..., 40 / 48) uint8;
    #                                i8: (..., 64) int8;
    #                                half: (n_rows, n_cols) uint16 bits of F16 or BF16
    d: np.ndarray | None = None    # (n_blocks, n_pad // sub, ROWS) scale: float32, float16 bits as uint16,
    #                                or a K-quant's sc (uint8/int8), times sup's D
    m: np.ndarray | None = None    # the same, or (1, n_pad // sub, 1) of zeros
    sup: np.ndarray | None = None  # K-quants: (n_blocks, n_pad // 256, 1 or 2, ROWS) uint16 float16 bits
    #                                of D (and -Dmin); else (1, 1, 1, 1) (made here)
    ms: int = 1                    # step of m's block and row index: 1, or 0 for the zeros
    c: float = 0.0                 # code offset: weight = d * (code + c) + m
    # derived once (the decode path reads them per call): columns after padding to whole
    # 64-weight groups, c as the kernels take it, and the integer kernel family (KINDS, or -1)
    n_pad: int = dataclasses.field(init=False)
    c32: np.float32 = dataclasses.field(init=False)
    kind: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.n_pad = self.shape[1] if self.d is None else self.d.shape[1] * self.sub
        if self.d is not None and self.sup is None:
            self.sup = np.zeros((1, 1, 1, 1), np.uint16)
        self.c32 = np.float32(self.c)
        self.kind = KINDS.get((self.layout, self.sub), -1)

    def rows(self, r0: int, r1: int) -> "PackedWeight":
        """Rows r0..r1 as a PackedWeight of views (no copies); r0 a multiple of ROWS for the
        blocked layouts."""
        r1 = min(r1, self.shape[0])
        shape = (r1 - r0, self.shape[1])
        if self.d is None:
            return dataclasses.replace(self, shape=shape, w=None if self.w is None else self.w[r0:r1],
                                       qs=None if self.qs is None else self.qs[r0:r1])
        assert r0 % ROWS == 0, r0
        b = slice(r0 // ROWS, -(-r1 // ROWS))
        return dataclasses.replace(self, shape=shape, qs=self.qs[b], d=self.d[b], m=self.m[b] if self.ms else self.m,
                                   sup=self.sup[b] if self.split else self.sup)

    @property
    def split(self) -> bool:
        """Whether d (and m) are small integers times `sup`'s super-block scales (K-quants)."""
        return self.d is not None and self.d.dtype.itemsize == 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w, self.qs, self.d, self.m, self.sup) if a is not None)


def pack_weight(ggml_type: int, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Repack raw GGUF rows (n_rows, row_bytes) uint8, possibly a read-only memmap."""
    ggml_type = int(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        name = T(ggml_type).name if ggml_type in T._value2member_map_ else str(ggml_type)
        raise UnsupportedModelError(f"the CPU backend cannot run weights of type {name}")
    n_rows, n_cols = (int(s) for s in shape)
    block, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    raw = np.asarray(raw)
    if n_cols % block or raw.dtype != np.uint8 or raw.size != n_rows * (n_cols // block) * type_size:
        raise ValueError(f"{T(ggml_type).name} weight of shape {shape}: expected {n_cols} columns "
                         f"in whole blocks of {block} and {n_rows} rows of raw uint8 bytes, "
                         f"got {raw.dtype} {raw.shape}")
    raw = raw.reshape(n_rows, -1)
    if ggml_type == T.F32:
        # zero-copy view of the mmap when it is contiguous; BLAS reads it as is
        w = np.ascontiguousarray(raw).view(np.float32).reshape(n_rows, n_cols)
        return PackedWeight(ggml_type, (n_rows, n_cols), "f32", w=w)
    if ggml_type in FLOAT_TYPES:  # F16, BF16
        bits = np.ascontiguousarray(raw).view(np.uint16).reshape(n_rows, n_cols)
        return PackedWeight(ggml_type, (n_rows, n_cols), "half", qs=bits)
    out = None
    for r0 in range(0, n_rows, PACK_ROWS):  # a slice at a time: the temporaries stay small
        r1 = min(r0 + PACK_ROWS, n_rows)
        part = _pack_codes(ggml_type, (r1 - r0, n_cols), *_UNPACKERS[ggml_type](raw[r0:r1], r1 - r0, n_cols))
        release_pages(raw[r0:r1])  # the file's copy of these rows is not read again
        if r1 - r0 == n_rows:
            return part
        if out is None:
            blk = lambda a: np.empty((-(-n_rows // ROWS), *a.shape[1:]), a.dtype)  # noqa: E731
            out = dataclasses.replace(part, shape=(n_rows, n_cols), qs=blk(part.qs), d=blk(part.d),
                                      m=blk(part.m) if part.ms else part.m,
                                      sup=blk(part.sup) if part.split else part.sup)
        b = slice(r0 // ROWS, r0 // ROWS + part.qs.shape[0])
        out.qs[b], out.d[b] = part.qs, part.d
        if part.ms:
            out.m[b] = part.m
        if part.split:
            out.sup[b] = part.sup
    return out


def _pack_codes(ggml_type, shape, layout, sub, codes, d, m, c) -> PackedWeight:
    """codes (n_rows, n_cols) uint8/int8, d and m (n_rows, n_cols // sub) or m None -> kernel layout;
    K-quants' d and m are pairs (D bits (n_rows, n_cols // 256) uint16, sc (n_rows, n_cols // sub))."""
    n_rows, n_cols = shape
    n_pad = -(-n_cols // 64) * 64
    n_blk = -(-n_rows // ROWS)
    pad = ((0, n_blk * ROWS - n_rows), (0, n_pad - n_cols))  # zero codes and scales contribute nothing
    codes = np.pad(codes, pad)
    pad_s = ((0, pad[0][1]), (0, pad[1][1] // sub))
    if layout in ("nib", "nib5", "nib6", *LUTS):
        per_row = codes.reshape(n_blk, ROWS, n_pad // 64, 2, 8, 4)  # (block, row, group, half, j, b): weight 32h+4j+b
        # byte (j, row i, b) of a group: weight 4j+b in the low nibble, 32+4j+b in the high
        nib = (per_row[:, :, :, 0] & 15) | ((per_row[:, :, :, 1] & 15) << 4)  # (block, row, group, j, b)
        qs = nib.astype(np.uint8).transpose(0, 2, 3, 1, 4).reshape(n_blk, n_pad // 64, 512)
        if layout == "nib5":  # per load j and half: a 64-bit mask, bit 4i+b = row i's weight's fifth bit
            five = ((per_row >> 4) & 1).astype(np.uint8).transpose(0, 2, 4, 3, 1, 5)  # (block, group, j, half, row, b)
            bits = np.packbits(five.reshape(n_blk, n_pad // 64, 8, 2, 64), axis=-1, bitorder="little")
            qs = np.concatenate([qs, bits.reshape(n_blk, n_pad // 64, 128)], axis=-1)
        if layout == "nib6":  # nibble vector v = 2j + half takes bits 2(v % 4) of plane v // 4, byte 4i+b
            top = ((per_row >> 4) & 3).astype(np.uint8).transpose(0, 2, 4, 3, 1, 5)  # (block, group, j, half, row, b)
            top = top.reshape(n_blk, n_pad // 64, 4, 4, 64)  # (block, group, plane, v % 4, 4i+b)
            plane = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
            qs = np.concatenate([qs, plane.reshape(n_blk, n_pad // 64, 256)], axis=-1)
        qs = qs.reshape(n_blk, n_pad // 64, ROWS, -1)
    else:  # (block, group, j, 4i+b): row i's weight 4j+b, j < 16
        i8 = codes.astype(np.int8, copy=False).reshape(n_blk, ROWS, n_pad // 64, 16, 4)
        qs = np.ascontiguousarray(i8.transpose(0, 2, 3, 1, 4)).reshape(n_blk, n_pad // 64, ROWS, 64)
    blocked = lambda a: np.ascontiguousarray(a.reshape(n_blk, ROWS, *a.shape[1:]).swapaxes(1, 2))
    # float16 bits where every scale is a float16 of the file (the simple quants): a sixth of
    # Q4_1's bytes, read at memory speed by decode; float32 where they are products (K-quants)
    half = ggml_type in HALF_SCALE_TYPES
    stored = lambda a: a.astype(np.float16).view(np.uint16) if half else a
    scales = lambda a: blocked(stored(np.pad(np.asarray(a, dtype=np.float32), pad_s)))
    sup = None
    if isinstance(d, tuple):  # K-quants: the integers as they are, D and -Dmin beside them (n_cols % 256 == 0)
        sup = np.stack([blocked(np.pad(pair[0], (pad_s[0], (0, 0)))) for pair in (d, m) if pair is not None], axis=2)
        scales = lambda a: blocked(np.pad(a[1], pad_s))  # noqa: E731
    ms = 0 if m is None else 1
    m = stored(np.zeros((1, n_pad // sub, 1), dtype=np.float32)) if m is None else scales(m)
    return PackedWeight(ggml_type, shape, layout, sub, qs=np.ascontiguousarray(qs), d=scales(d), m=m, sup=sup,
                        ms=ms, c=float(c))


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
    return "i8", 32, b[..., 2:].view(np.int8).reshape(n_rows, n_cols), f16_field(b, 0), None, 0


def _q4_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 18)
    return "nib", 32, _nibbles_32(b[..., 2:]).reshape(n_rows, n_cols), f16_field(b, 0), None, -8


def _q4_1(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 20)
    return "nib", 32, _nibbles_32(b[..., 4:]).reshape(n_rows, n_cols), f16_field(b, 0), f16_field(b, 2), 0


def _q5_0(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 22)
    codes = _nibbles_32(b[..., 6:]) | (_high_bits_32(b[..., 2:6]) << 4)
    return "nib5", 32, codes.reshape(n_rows, n_cols), f16_field(b, 0), None, -16


def _q5_1(raw, n_rows, n_cols):
    b = _blocks(raw, n_rows, n_cols, 24)
    codes = _nibbles_32(b[..., 8:]) | (_high_bits_32(b[..., 4:8]) << 4)
    return "nib5", 32, codes.reshape(n_rows, n_cols), f16_field(b, 0), f16_field(b, 2), 0


_UNPACKERS = {
    int(T.Q8_0): _q8_0, int(T.Q4_0): _q4_0, int(T.Q4_1): _q4_1,
    int(T.Q5_0): _q5_0, int(T.Q5_1): _q5_1, **KQUANT_UNPACKERS, **IQUANT_UNPACKERS,
}
