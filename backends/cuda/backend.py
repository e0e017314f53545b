"""The CuPy GPU backend: raw GGUF blocks on the device read by the .cu kernels (kernels/),
cuBLAS for float products. CuPy is imported when the backend is made, not when this
module is: `hearthlm.backends.cuda` imports on any machine, and making the backend where
CuPy or a device is missing raises BackendError saying which.

Streams: kernels run on the engine thread's current stream (the compute stream); uploads
from other backends go on a copy stream of their own, ordered against it by events."""
from __future__ import annotations

from typing import Any

import numpy as np

from hearthlm.backends.cuda.weights import SUPPORTED_TYPES
from hearthlm.core import array_ops
from hearthlm.core.backend import Backend
from hearthlm.core.errors import BackendError
from hearthlm.core.graph import Op, Tensor
from hearthlm.core.weights import QWeight

# CuPy ships one package per CUDA major, and two of them in one environment break `import
# cupy`: hence one extra per major and no plain `gpu` extra that would pick one for the user
INSTALL_HINT = ("pip install 'hearthlm[gpu-cuda13]' or 'hearthlm[gpu-cuda12]', for the CUDA version "
                "`nvidia-smi` shows; an environment that has a CuPy already needs neither")


def load_cupy():
    """The cupy module, once it is known to see a CUDA device; else BackendError."""
    try:
        import cupy
    except ImportError as e:
        raise BackendError(f"the cuda backend needs CuPy: {INSTALL_HINT} ({e})") from e
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver or device
        raise BackendError(f"the cuda backend found no CUDA device: {e}") from e
    if n == 0:
        raise BackendError("the cuda backend found no CUDA device")
    return cupy


class CUDABackend(Backend):
    name = "cuda"
    weight_types = SUPPORTED_TYPES
    plans_memory = False  # kernels allocate from CuPy's memory pool; the planner's arena is host memory
    kv_dtype = np.dtype(np.float32)  # what op tests feed an untagged cache; the runtime stores core.kv_types

    def __init__(self, device: int = 0) -> None:
        self.cp = load_cupy()
        self.device = self.cp.cuda.Device(device)
        self.device.use()  # for the uploads at load, in the caller's thread; bind_thread for the engine's
        from hearthlm.backends.cuda import ops  # needs cupy
        self._copy_stream = self.cp.cuda.Stream(non_blocking=True)
        self._inflight: list = []  # (event, pinned block) of uploads that may still be running
        self.kernels = dict(ops.KERNELS)

    def bind_thread(self) -> None:
        self.device.use()  # the current device is per thread in CUDA

    def graph_runner(self, cg):
        """Small steps (decode) replay as CUDA graphs: backends/cuda/graphs.py."""
        from hearthlm.backends.cuda.graphs import runner
        return runner(self, cg)

    def loaded(self) -> None:
        """cupy.asarray stages every upload in CuPy's pinned pool, which keeps its blocks
        for reuse: the size of the biggest weights, for as long as the process lives."""
        cp = self.cp
        self.device.synchronize()
        self._inflight.clear()
        cp.cuda.alloc_pinned_memory(0)  # CuPy lets go of staging blocks whose copies are done on its next alloc
        cp.get_default_pinned_memory_pool().free_all_blocks()

    def prepare_weight(self, w: QWeight) -> Any:
        from hearthlm.backends.cuda.weights import upload
        if len(w.shape) == 3:  # stacked experts: one device weight each
            n_exp, rows = w.shape[0], w.shape[1]
            return tuple(upload(self.cp, QWeight(f"{w.name}#{e}", w.ggml_type, w.shape[1:],
                                                 w.raw[e * rows:(e + 1) * rows])) for e in range(n_exp))
        return upload(self.cp, w)

    def supports(self, node: Tensor) -> bool:
        if node.op is Op.ATTN:
            from hearthlm.backends.cuda.ops import MAX_HEAD_DIM
            return max(node.srcs[0].shape[2], node.srcs[2].shape[2]) <= MAX_HEAD_DIM
        return super().supports(node)

    def memory_available(self) -> int | None:
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())  # the pool's spare blocks too

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype)  # made on the device, not uploaded through pinned memory

    def to_host(self, value):
        return self.cp.asnumpy(value) if isinstance(value, self.cp.ndarray) else value

    def from_host(self, array):
        return self.cp.asarray(array)

    def argmax_rows(self, value):
        """On the device: a step's greedy rows copy back an id each, not their logits."""
        if not isinstance(value, self.cp.ndarray):
            return super().argmax_rows(value)
        return self.cp.asnumpy(self.cp.argmax(value, axis=1))

    def top_k_rows(self, value, ks):
        """On the device: a sampled step copies back k candidates a row, not its logits."""
        if not isinstance(value, self.cp.ndarray):
            return super().top_k_rows(value, ks)
        return array_ops.top_k_rows(value, ks, self.cp)

    def copy_from(self, src: Backend, value):
        """A tensor from another split. Host data is staged into pinned memory (the source
        buffer may be reused as soon as this returns) and copied on the copy stream, so the
        copy overlaps the kernels queued before it. The copy waits for the compute stream
        first: the pool may hand out a block that kernels queued there still read. The
        compute stream then waits for the copy."""
        cp = self.cp
        if isinstance(value, cp.ndarray):
            return value.copy()
        host = np.ascontiguousarray(src.to_host(value))
        out = cp.empty(host.shape, host.dtype)  # from the compute stream's pool
        if host.size == 0:
            return out
        self._inflight = [(ev, mem) for ev, mem in self._inflight if not ev.done]
        mem = cp.cuda.alloc_pinned_memory(host.nbytes)
        staged = np.frombuffer(mem, host.dtype, host.size).reshape(host.shape)
        staged[...] = host
        compute = cp.cuda.get_current_stream()
        self._copy_stream.wait_event(compute.record())
        out.set(staged, stream=self._copy_stream)
        ev = self._copy_stream.record()
        compute.wait_event(ev)
        self._inflight.append((ev, mem))  # keep the pinned block alive until the copy is done
        return out
