"""numpy reference backend: the ground truth every other backend is tested against.
Clear over fast; weights are dequantized with `gguf.quants` (cached per weight)."""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from hearthlm.runtime.errors import UnsupportedModelError
from hearthlm.runtime.graph import Op, Tensor
from hearthlm.runtime.weights import QWeight


def dequantize(w: QWeight) -> np.ndarray:
    """float32 array of w.shape."""
    try:
        if w.ggml_type == T.F32:
            return w.raw.view(np.float32).reshape(w.shape)
        if w.ggml_type == T.F16:
            return w.raw.view(np.float16).astype(np.float32).reshape(w.shape)
        return np.asarray(quants.dequantize(w.raw, T(w.ggml_type)), np.float32).reshape(w.shape)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"{w.name}: weight type {T(w.ggml_type).name} is not supported") from e


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_scale: float, neox: bool) -> np.ndarray:
    """x (n_tokens, n_heads, head_dim); rotates the first n_rot dims of each head."""
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    theta = freq_scale * pos.astype(np.float64)[:, None] * inv_freq[None, :]  # (n_tokens, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.astype(np.float32).copy()
    if neox:
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def attention(q, k_cache, v_cache, tok_seq, tok_pos, block_table, *, scale, block_size, window):
    """q (n_tokens, n_head, d); caches (n_slots, n_head_kv, d). Each token attends to its
    sequence's positions [lo, pos] through the block table. Returns (n_tokens, n_head*d)."""
    n_tokens, n_head, _ = q.shape
    group = n_head // k_cache.shape[1]
    out = np.zeros((n_tokens, n_head, v_cache.shape[2]), np.float32)
    for t in range(n_tokens):
        pos = int(tok_pos[t])
        lo = max(0, pos - window + 1) if window > 0 else 0
        p = np.arange(lo, pos + 1)
        slots = block_table[tok_seq[t], p // block_size] * block_size + p % block_size
        k = np.repeat(k_cache[slots], group, axis=1)  # (n_kv, n_head, d)
        v = np.repeat(v_cache[slots], group, axis=1)
        s = np.einsum("hd,khd->hk", q[t].astype(np.float64), k) * scale
        s = np.exp(s - s.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hk,khd->hd", s, v)
    return out.reshape(n_tokens, -1)


def _set_rows(node, cache, src, slots):
    cache[slots] = src.reshape(len(slots), *cache.shape[1:])
    return cache


class ReferenceBackend:
    name = "reference"

    def __init__(self) -> None:
        self.kernels = {
            Op.GET_ROWS: lambda n, table, ids: np.ascontiguousarray(table[ids], np.float32),
            Op.MUL_MAT: lambda n, w, x: (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32),
            Op.RMS_NORM: lambda n, x: rms_norm(x, n.params["eps"]),
            Op.MUL: lambda n, a, b: (a * b).astype(np.float32),
            Op.ADD: lambda n, a, b: (a + b).astype(np.float32),
            Op.SCALE: lambda n, x: (x * np.float32(n.params["s"])).astype(np.float32),
            Op.SILU: lambda n, x: silu(x),
            Op.GELU: lambda n, x: gelu(x),
            Op.RESHAPE: lambda n, x: x.reshape(n.params["new_shape"]),
            Op.ROPE: lambda n, x, pos: rope(x, pos, n.params["n_rot"], n.params["base"],
                                            n.params["freq_scale"], n.params["neox"]),
            Op.SET_ROWS: _set_rows,
            Op.ATTN: lambda n, q, k, v, seq, pos, bt: attention(
                q, k, v, seq, pos, bt, scale=n.params["scale"], block_size=n.params["block_size"],
                window=n.params["window"]),
            Op.RMS_NORM_MUL: lambda n, x, w: (rms_norm(x, n.params["eps"]) * w).astype(np.float32),
            Op.GLU: lambda n, g, u: ((silu(g) if n.params["act"] == "silu" else gelu(g)) * u).astype(np.float32),
        }

    def prepare_weight(self, w: QWeight) -> np.ndarray:
        return dequantize(w)

    def supports(self, node: Tensor) -> bool:
        return node.op in self.kernels or node.op in (Op.INPUT, Op.WEIGHT, Op.CACHE)

    def to_host(self, value):
        return value

    def from_host(self, array):
        return array
