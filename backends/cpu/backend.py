"""The numba CPU backend: packed quantized weights (qtypes/matmul) and fused-friendly
kernels (ops). Elementwise ops that numpy already runs at memory speed stay numpy."""
from __future__ import annotations

import numpy as np

from hearthlm.backends.cpu import ops
from hearthlm.backends.cpu.matmul import get_rows, matmul
from hearthlm.backends.cpu.qtypes import SUPPORTED_TYPES, PackedWeight, pack_weight
from hearthlm.runtime.graph import Op, Tensor
from hearthlm.runtime.weights import QWeight

_NO_WEIGHT = np.zeros(0, np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])


def _rms_norm(node, x, w=None):
    out = np.empty(x.shape, np.float32)
    ops.rms_norm(_rows(x), _NO_WEIGHT if w is None else np.ascontiguousarray(w, np.float32).reshape(-1),
                 node.params["eps"], out.reshape(-1, x.shape[-1]))
    return out


def _glu(node, gate, up):
    out = np.empty(gate.shape, np.float32)
    ops.glu(_rows(gate), _rows(up), node.params["act"] == "gelu", out.reshape(-1, gate.shape[-1]))
    return out


def _act(gelu: bool):
    def k(node, x):
        out = np.empty(x.shape, np.float32)
        ops.glu(_rows(x), np.zeros((0, 0), np.float32), gelu, out.reshape(-1, x.shape[-1]))
        return out
    return k


def _rope(node, x, pos):
    p = node.params
    out = np.empty(x.shape, np.float32)
    ops.rope(np.ascontiguousarray(x, np.float32), pos, p["n_rot"], p["base"], p["freq_scale"], p["neox"], out)
    return out


def _set_rows(node, cache, src, slots):
    ops.set_rows(cache, np.ascontiguousarray(src, np.float32).reshape(len(slots), *cache.shape[1:]), slots)
    return cache


def _attn(node, q, k, v, seq, pos, bt):
    p = node.params
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    ops.attention(np.ascontiguousarray(q, np.float32), k, v, seq, pos, bt, p["scale"], p["block_size"],
                  p["window"], out)
    return out.reshape(q.shape[0], -1)


def _get_rows(node, table, ids):
    if isinstance(table, PackedWeight):
        return get_rows(table, ids)
    return np.ascontiguousarray(table[ids], np.float32)


class CPUBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = {
            Op.GET_ROWS: _get_rows,
            Op.MUL_MAT: lambda n, w, x: matmul(w, x),
            Op.RMS_NORM: _rms_norm,
            Op.RMS_NORM_MUL: _rms_norm,
            Op.MUL: lambda n, a, b: np.multiply(a, b, dtype=np.float32),
            Op.ADD: lambda n, a, b: np.add(a, b, dtype=np.float32),
            Op.SCALE: lambda n, x: np.multiply(x, np.float32(n.params["s"]), dtype=np.float32),
            Op.SILU: _act(False),
            Op.GELU: _act(True),
            Op.GLU: _glu,
            Op.RESHAPE: lambda n, x: x.reshape(n.params["new_shape"]),
            Op.ROPE: _rope,
            Op.SET_ROWS: _set_rows,
            Op.ATTN: _attn,
        }

    def prepare_weight(self, w: QWeight):
        if len(w.shape) == 1:  # norms and biases: plain float32 vectors
            from hearthlm.backends.reference import dequantize
            return np.ascontiguousarray(dequantize(w))
        return pack_weight(w.ggml_type, w.raw, w.shape)

    def supports(self, node: Tensor) -> bool:
        if node.op is Op.WEIGHT:
            return node.params["weight"].ggml_type in SUPPORTED_TYPES
        return node.op in self.kernels or node.op in (Op.INPUT, Op.CACHE)

    def to_host(self, value):
        return value

    def from_host(self, array):
        return array
