"""KV cache types (Session.open(kv_cache_type=...)), as llama.cpp's -ctk / -ctv: a registry of
records, each type used by its NAME. A record holds the block layout (values and bytes per block
along head_dim), the cache array's element type, ggml's type id, and the numpy reference of its
quantization (ggml-quants.c's quantize_row_*_ref / dequantize_row_*, bit for bit; gguf.quants is
the tests' oracle). A cache is (n_slots, h_kv, row): a float type's row is its d values, a
quantized type's row is its blocks as bytes (uint8), so copying K/V by slot copies bytes.

The type is on the cache tensor in the graph, as ggml's type_k / type_v: the runtime's KV cache
tags each CACHE node's params ("kv_type", and "kv_rot" below) and backends choose their kernels
from the node when they bind it (`of`), never from the array's dtype. A CACHE node without a tag
(op tests, recurrent state) is a float cache of whatever float array it is given.

"<type>+rot" adds llama.cpp's Walsh-Hadamard rotation of quantized K and V (its PR #21038, on by
default there): K and Q are rotated by the same orthonormal H (q.k unchanged), V is stored rotated
and the attention output rotated back (H is symmetric and H H = I). Rows are rotated in chunks of
n values along head_dim before quantization: n = 64 for V, the largest power of two dividing
head_dim for K (llama.cpp's llama_kv_cache::build_input_k_rot / _v_rot); head_dim % 64 == 0.
Its values, as the unfused path and the reference read them, are H (dequantized rows): the
rotation is part of the stored format, so graphs do not change. Imports only core.graph."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hearthlm.core.graph import Op

ROT = "+rot"
ROT_MIN = 64  # llama.cpp rotates where head_dim % 64 == 0


@dataclass(frozen=True)
class KVType:
    name: str             # as llama.cpp's -ctk / -ctv name it
    ggml_type: int        # ggml's type id (the cpu and cuda kernels' code for it)
    block: int            # values per block along head_dim (1: a float type)
    block_bytes: int      # bytes per block
    storage: np.dtype     # the cache array's element type: float32, float16, or uint8 (blocks)
    quantize: Callable[[np.ndarray], np.ndarray]    # reference: (..., d) float32 -> (..., row) of storage
    dequantize: Callable[[np.ndarray], np.ndarray]  # reference: (..., row) -> (..., d) float32

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row(self, d: int) -> int:
        """Elements of `storage` a (slot, head) row of d values takes."""
        return d // self.block * self.block_bytes if self.quantized else d

    def head_dim(self, row: int) -> int:
        return row // self.block_bytes * self.block if self.quantized else row


# ---- numpy references (ggml-quants.c), on blocks (n, 32) float32 -> (n, bytes) uint8 ----

_KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _half_of(b: np.ndarray, o: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, o:o + 2]).view(np.float16).astype(np.float32)  # (n, 1)


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per block (the first of ties), (n, 1)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """codes (n, 32) -> (n, 16): value j < 16 in the low nibble of byte j, 16 + j in the high."""
    return ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).astype(np.uint8)


def _unnibble(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 0xF, b >> 4], axis=1).astype(np.int32)


def _qh(q: np.ndarray) -> np.ndarray:
    """Bit 4 of code j as bit j of a little-endian uint32 (q5_0 / q5_1's qh)."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little").astype(np.uint8)


def _high(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little").astype(np.int32) << 4


def _q8_0(x):
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    v = x * _inv(d)
    a = np.abs(v)
    q = np.sign(v) * (np.floor(a) + np.floor(np.float32(2) * (a - np.floor(a))))  # roundf: half away from 0
    return np.concatenate([_half_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def _q4_0(x):
    d = _signed_max(x) / np.float32(-8)
    q = np.minimum(15, np.trunc(x * _inv(d) + np.float32(8.5)).astype(np.int32))
    return np.concatenate([_half_bytes(d), _nibbles(q)], axis=1)


def _q5_0(x):  # {f16 d; u8 qh[4]; u8 qs[16]}
    d = _signed_max(x) / np.float32(-16)
    q = np.minimum(31, np.trunc(x * _inv(d) + np.float32(16.5)).astype(np.int32))
    return np.concatenate([_half_bytes(d), _qh(q), _nibbles(q)], axis=1)


def _q5_1(x):  # {f16 d; f16 m; u8 qh[4]; u8 qs[16]}
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.trunc((x - lo) * _inv(d) + np.float32(0.5)).astype(np.int32) & 31  # a uint8 cast; never over 31
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _qh(q), _nibbles(q)], axis=1)


def _iq4_nl(x):
    """quantize_row_iq4_nl_ref (ntry -1): codes nearest to x / d0 in the non-linear table at d0 = max / -127,
    then the least-squares scale of those codes weighted by x^2, summed in float32 in order. An
    all-zero block (amax < 1e-15) gets d 0 (its codes, stale in ggml, are 0 here)."""
    kv = _KVALUES_IQ4NL
    with np.errstate(divide="ignore", invalid="ignore"):
        al = x * (np.float32(1) / (_signed_max(x) / kv[0]))
    mu = np.clip(np.searchsorted(kv, al, side="right"), 1, 15)  # kv[mu-1] <= al < kv[mu] inside the table
    near = np.where(al - kv[mu - 1] < kv[mu] - al, mu - 1, mu)
    q = np.where(al <= kv[0], 0, np.where(al >= kv[15], 15, near))
    zero = np.abs(x).max(axis=1) < np.float32(1e-15)
    q[zero] = 0
    val = kv[q]
    w = x * x
    sumqx, sumq2 = np.zeros(len(x), np.float32), np.zeros(len(x), np.float32)
    for j in range(x.shape[1]):  # float32, in ggml's order
        sumqx += w[:, j] * val[:, j] * x[:, j]
        sumq2 += w[:, j] * val[:, j] * val[:, j]
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where((sumq2 > 0) & ~zero, sumqx / sumq2, np.float32(0)).astype(np.float32)
    return np.concatenate([_half_bytes(d), _nibbles(q)], axis=1)


def _dq8_0(b):
    return _half_of(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _dq4_0(b):
    return _half_of(b, 0) * (_unnibble(b[:, 2:]) - 8).astype(np.float32)


def _dq5_0(b):
    return _half_of(b, 0) * ((_unnibble(b[:, 6:]) | _high(b[:, 2:6])) - 16).astype(np.float32)


def _dq5_1(b):
    return _half_of(b, 0) * (_unnibble(b[:, 8:]) | _high(b[:, 4:8])).astype(np.float32) + _half_of(b, 2)


def _diq4_nl(b):
    return _half_of(b, 0) * _KVALUES_IQ4NL[_unnibble(b[:, 2:])]


def _blockwise(fn, block: int, nbytes: int):
    """A per-block reference as rows: (..., d) float32 -> (..., d // block * nbytes) uint8."""
    def quantize(x):
        x = np.ascontiguousarray(x, np.float32)
        return fn(x.reshape(-1, block)).reshape(*x.shape[:-1], x.shape[-1] // block * nbytes)
    return quantize


def _unblockwise(fn, block: int, nbytes: int):
    def dequantize(rows):
        rows = np.ascontiguousarray(rows).view(np.uint8)
        return fn(rows.reshape(-1, nbytes)).reshape(*rows.shape[:-1], rows.shape[-1] // nbytes * block)
    return dequantize


def _float(dt):
    return (lambda x: np.asarray(x, np.float32).astype(dt), lambda rows: np.asarray(rows, np.float32))


def _quant(name, ggml_type, nbytes, q, dq):
    return KVType(name, ggml_type, 32, nbytes, np.dtype(np.uint8), _blockwise(q, 32, nbytes),
                  _unblockwise(dq, 32, nbytes))


# name -> record; the order is the one messages list them in
KV_TYPES: dict[str, KVType] = {t.name: t for t in (
    KVType("f16", 1, 1, 2, np.dtype(np.float16), *_float(np.float16)),
    _quant("q8_0", 8, 34, _q8_0, _dq8_0),
    _quant("q4_0", 2, 18, _q4_0, _dq4_0),
    _quant("q5_0", 6, 22, _q5_0, _dq5_0),
    _quant("q5_1", 7, 24, _q5_1, _dq5_1),
    _quant("iq4_nl", 20, 18, _iq4_nl, _diq4_nl),
    KVType("f32", 0, 1, 4, np.dtype(np.float32), *_float(np.float32)),
)}
NAMES = tuple(KV_TYPES)
QUANTIZED = tuple(n for n, t in KV_TYPES.items() if t.quantized)


# ---- the option: a type's name, "+rot" for the rotation ----

def parse(spec: str) -> tuple[KVType, bool]:
    """(record, rotated) of a kv_cache_type option; KeyError for an unknown one."""
    base, rot = (spec[:-len(ROT)], True) if spec.endswith(ROT) else (spec, False)
    t = KV_TYPES[base]
    if rot and not t.quantized:
        raise KeyError(spec)
    return t, rot


def check(spec: str, kv_dims) -> str | None:
    """Why `spec` cannot hold these layers' K/V ((n_head_kv, head_dim) each; (0, 0) for a layer
    without attention), or None when it can."""
    try:
        t, rot = parse(spec)
    except KeyError:
        return (f"kv_cache_type must be one of {', '.join(NAMES)} (a quantized one with {ROT}: llama.cpp's "
                f"Hadamard rotation of K/V, e.g. q4_0{ROT}), not {spec!r}")
    need = ROT_MIN if rot else t.block
    bad = sorted({d for h, d in kv_dims if h and d % need})
    if bad:
        what = f"rotates blocks of {ROT_MIN}" if rot else f"stores blocks of {t.block} values"
        return (f"kv_cache_type {spec} {what} along head_dim; this model's head_dim is {bad[0]}, "
                f"not a multiple of {need}: use {t.name if rot else 'f16'}")
    return None


def rot_sizes(spec: str, d: int) -> tuple[int, int]:
    """The Hadamard sizes (K, V) of a layer of head_dim d; 0 for none."""
    _, rot = parse(spec)
    if not rot:
        return 0, 0
    n = ROT_MIN
    while d % (2 * n) == 0:
        n *= 2
    return n, ROT_MIN


def key_name(spec: str) -> str:
    """The type as the prompt cache's on-disk key names it: the dtype string for a float type (what
    an f16 or float32 cache's key always was, so those files stay valid), else the option itself."""
    t, _ = parse(spec)
    return spec if t.quantized else t.storage.str


# ---- on the graph ----

def tag(cache_node, spec: str, rot: int = 0) -> None:
    """Name a CACHE node's type (ggml's type_k / type_v) and its Hadamard size (0: none)."""
    t, _ = parse(spec)
    cache_node.params["kv_type"] = t.name
    cache_node.params["kv_rot"] = int(rot)


def cache_node(node):
    """The CACHE leaf under a node that reads a cache (through the ops that write it)."""
    while node.op is not Op.CACHE and node.srcs:
        node = node.srcs[0]
    return node


def of(node) -> tuple[KVType | None, int]:
    """(record, Hadamard size) of the cache `node` reads or is; (None, 0) for an untagged cache."""
    p = cache_node(node).params
    name = p.get("kv_type")
    return (None, 0) if name is None else (KV_TYPES[name], int(p.get("kv_rot", 0)))


# ---- the rotation's reference ----

def hadamard(n: int) -> np.ndarray:
    """(n, n) orthonormal Walsh-Hadamard matrix (Sylvester's order, as ggml_gen_hadamard): symmetric, H H = I."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(x: np.ndarray, n: int) -> np.ndarray:
    """x (..., d) with each run of n values along d multiplied by H_n (its own inverse); n 0: x."""
    if not n:
        return x
    x = np.asarray(x, np.float32)
    return (x.reshape(*x.shape[:-1], x.shape[-1] // n, n) @ hadamard(n)).reshape(x.shape)


def encode(t: KVType, rot: int, x: np.ndarray) -> np.ndarray:
    """x (..., d) float32 as cache rows of type t (rotated first where rot)."""
    return t.quantize(rotate(x, rot))


def decode(t: KVType, rot: int, rows: np.ndarray) -> np.ndarray:
    """Cache rows of type t as their values (..., d) float32."""
    return rotate(t.dequantize(rows), rot)
