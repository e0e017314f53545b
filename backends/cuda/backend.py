"""The CuPy GPU backend: raw GGUF blocks on the device read by the .cu kernels (kernels/),
cuBLAS for float products. CuPy is imported when the backend is made, not when this
module is: `hearthlm.backends.cuda` imports on any machine, and making the backend where
CuPy or a device is missing raises BackendError saying which."""
from __future__ import annotations

from typing import Any

import numpy as np

from hearthlm.backends.cuda.weights import SUPPORTED_TYPES
from hearthlm.runtime.errors import BackendError
from hearthlm.runtime.graph import Op, Tensor
from hearthlm.runtime.weights import QWeight


def load_cupy():
    """The cupy module, once it is known to see a CUDA device; else BackendError."""
    try:
        import cupy
    except ImportError as e:
        raise BackendError("the cuda backend needs CuPy: pip install 'hearthlm[gpu]' "
                           f"(cupy-cuda12x) ({e})") from e
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver or device
        raise BackendError(f"the cuda backend found no CUDA device: {e}") from e
    if n == 0:
        raise BackendError("the cuda backend found no CUDA device")
    return cupy


class CUDABackend:
    name = "cuda"
    plans_memory = False  # kernels allocate from CuPy's memory pool; the planner's arena is host memory

    def __init__(self, device: int = 0) -> None:
        self.cp = load_cupy()
        self.cp.cuda.Device(device).use()
        from hearthlm.backends.cuda import ops  # needs cupy
        self._copy_stream = self.cp.cuda.Stream(non_blocking=True)
        self._inflight: list = []
        self.kernels = {
            Op.GET_ROWS: ops.get_rows,
            Op.MUL_MAT: ops.mul_mat,
            Op.MUL_MAT_ADD: ops.mul_mat_add,
            Op.FFN_GLU: ops.ffn_glu,
            Op.RMS_NORM: ops.rms_norm,
            Op.RMS_NORM_MUL: ops.rms_norm,
            Op.RMS_NORM_MUL_ADD: ops.rms_norm,
            Op.MUL: lambda n, a, b, out=None: ops._into(self.cp.multiply(a, b, dtype=self.cp.float32), out),
            Op.ADD: lambda n, a, b, out=None: ops._into(self.cp.add(a, b, dtype=self.cp.float32), out),
            Op.ADD_N: ops.add_n,
            Op.SCALE: lambda n, x, out=None: ops._into(
                self.cp.multiply(x, np.float32(n.params["s"]), dtype=self.cp.float32), out),
            Op.SILU: ops.activation("silu"),
            Op.GELU: ops.activation("gelu"),
            Op.TANH: lambda n, x, out=None: ops._into(self.cp.tanh(x, dtype=self.cp.float32), out),
            Op.GLU: ops.glu,
            Op.RESHAPE: lambda n, x: x.reshape(n.params["new_shape"]),
            Op.SLICE: lambda n, x: self.cp.ascontiguousarray(x[..., n.params["start"]:n.params["stop"]]),  # raw kernels need dense
            Op.ROPE: ops.rope,
            Op.SET_ROWS: ops.set_rows,
            Op.ROPE_SET_ROWS: ops.rope_set_rows,
            Op.ATTN: ops.attn,
            Op.GATHER_KV: ops.gather_kv,
            Op.KQ: ops.kq,
            Op.KQ_MASK: ops.kq_mask,
            Op.SOFT_MAX: ops.soft_max,
            Op.KQV: ops.kqv,
            Op.TOP_K: ops.top_k,
            Op.TAKE: lambda n, x, ids, out=None: ops._into(self.cp.take_along_axis(x, ids.astype(self.cp.int64), -1), out),
            Op.SUM_ROWS: lambda n, x, out=None: ops._into(self.cp.sum(x, axis=-1, keepdims=True, dtype=self.cp.float32), out),
            Op.DIV: lambda n, a, b, out=None: ops._into(self.cp.divide(a, b, dtype=self.cp.float32), out),
            Op.MUL_MAT_ID: ops.mul_mat_id,
        }

    def prepare_weight(self, w: QWeight) -> Any:
        from hearthlm.backends.cuda.weights import upload
        if len(w.shape) == 3:  # stacked experts: one device weight each
            n_exp, rows = w.shape[0], w.shape[1]
            return tuple(upload(self.cp, QWeight(f"{w.name}#{e}", w.ggml_type, w.shape[1:],
                                                 w.raw[e * rows:(e + 1) * rows])) for e in range(n_exp))
        return upload(self.cp, w)

    def supports(self, node: Tensor) -> bool:
        if node.op is Op.WEIGHT:
            return int(node.params["weight"].ggml_type) in SUPPORTED_TYPES
        if node.op is Op.ATTN:
            from hearthlm.backends.cuda.ops import MAX_HEAD_DIM
            return max(node.srcs[0].shape[2], node.srcs[2].shape[2]) <= MAX_HEAD_DIM
        return node.op in self.kernels or node.op in (Op.INPUT, Op.CACHE)

    def to_host(self, value):
        return self.cp.asnumpy(value) if isinstance(value, self.cp.ndarray) else value

    def from_host(self, array):
        return self.cp.asarray(array)

    def copy_from(self, src_backend, value):
        """A tensor from another split. Host data is staged into pinned memory (the source
        buffer may be reused as soon as this returns), copied on the copy stream, and the
        compute stream waits on an event: the copy overlaps the kernels queued before it."""
        cp = self.cp
        if isinstance(value, cp.ndarray):
            return value.copy()
        host = np.ascontiguousarray(src_backend.to_host(value))
        self._inflight = [(ev, mem) for ev, mem in self._inflight if not ev.done]  # pinned blocks in use
        mem = cp.cuda.alloc_pinned_memory(max(host.nbytes, 1))
        staged = np.frombuffer(mem, host.dtype, host.size).reshape(host.shape)
        staged[...] = host
        out = cp.empty(host.shape, host.dtype)
        out.set(staged, stream=self._copy_stream)
        ev = self._copy_stream.record()
        cp.cuda.get_current_stream().wait_event(ev)
        self._inflight.append((ev, mem))  # keep the pinned block alive until the copy is done
        return out
