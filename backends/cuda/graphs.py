"""Decode steps as CUDA graphs. A step's walk makes several CuPy calls per op (about 300
launches and 500 allocations a token on a 24-layer model: ~8 ms of host time, the GPU idle
most of it); the same step captured once replays in one launch.

A compiled graph of up to MAX_TOKENS (32) tokens (decode of up to 32 streams) runs eagerly on its
first use (kernels compile, constants upload), is captured on its second, and replays after.
What a replay must find where the capture left it:
- the inputs: uploaded into buffers of the graph's own before each replay;
- every buffer the kernels wrote: they come from a memory pool of the graph's own, so no
  other allocation can be handed a block the graph still writes;
- the caches (K/V, recurrent state): the same device arrays (their addresses are the key;
  a change captures again);
- no data-dependent launch: the kernels read lengths and positions from device arrays.
Not captured, so run eagerly: a graph with an op that reads device data on the host
(mul_mat_id's expert ids), and one that calls cuBLAS (float weights, the unfused attention),
which CuPy refuses during a capture. A capture that fails anyway leaves its graph eager from
then on. HEARTHLM_CUDA_GRAPHS=0 turns capture off."""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import structlog

from hearthlm.backends.cuda.weights import MMVQ_MAX_TOKENS, quantized
from hearthlm.core.backend import CACHE, COPY, INPUT, STATIC
from hearthlm.core.graph import Op

log = structlog.get_logger("hearthlm.cuda")

# the mmvq path's: bigger steps dequantize weights into slabs (cuBLAS), which a graph's pool would keep
MAX_TOKENS = MMVQ_MAX_TOKENS
HOST_OPS = frozenset({Op.MUL_MAT_ID})  # read device data on the host: not capturable
BLAS_OPS = frozenset({Op.KQ, Op.KQV})   # cupy.matmul: cuBLAS
# cuBLAS unless the weight is quantized
PRODUCTS = frozenset({Op.MUL_MAT, Op.MUL_MAT_ADD, Op.FFN_GLU, Op.MUL_MAT_LORA, Op.MUL_MAT_ADD_LORA, Op.FFN_GLU_LORA})


def enabled() -> bool:
    return os.environ.get("HEARTHLM_CUDA_GRAPHS", "1") not in ("0", "false", "no", "off")


def runner(backend, cg) -> Callable[..., Any] | None:
    """A GraphReplay for `cg` where capture applies, else None."""
    if not enabled():
        return None
    tokens = next((st for st in cg.steps if st.kind is INPUT and st.node.name == "tokens"), None)
    if tokens is None or tokens.node.shape[0] > MAX_TOKENS:
        return None
    if any(st.kind is COPY or st.node.op in HOST_OPS | BLAS_OPS for st in cg.steps):
        return None
    weights = (cg.steps[st.srcs[0]] for st in cg.steps if st.node.op in PRODUCTS)
    if not all(w.kind is STATIC and quantized(w.value) for w in weights):
        return None
    return GraphReplay(backend, cg)


class GraphReplay:
    def __init__(self, backend, cg) -> None:
        self.backend, self.cg = backend, cg
        self.inputs = [(st.index, st.node.name) for st in cg.steps if st.kind is INPUT]
        self.cache_nodes = [st.node for st in cg.steps if st.kind is CACHE]
        self.uses = 0
        self.failed = False
        # set by each capture: the graph, its outputs, input buffers, pool, replay stream, cache key
        self.graph = self.outs = self.statics = self.pool = self.run_stream = None
        self.key: tuple = ()
        self.counters = dict(captures=0, replays=0)

    def __call__(self, feed, cache_of, keep=frozenset()):
        self.uses += 1
        if self.failed or self.uses == 1:
            return None  # the first run is eager: it compiles kernels and uploads constants
        key = tuple(int(cache_of(n).data.ptr) for n in self.cache_nodes)
        if self.graph is None or key != self.key:
            return self._capture(feed, cache_of, key, keep)
        cp = self.backend.cp
        with self.run_stream:
            for i, name in self.inputs:
                x = feed[name]
                buf = self.statics[i]
                if x.shape != buf.shape or x.dtype != buf.dtype:
                    return None  # not the captured shape (the graph cache keys on it: should not happen)
                buf.set(np.ascontiguousarray(x))
            self.graph.launch(self.run_stream)
            self.counters["replays"] += 1
            host = [o if i in keep else cp.asnumpy(o, stream=self.run_stream) for i, o in enumerate(self.outs)]
            if keep:  # what is kept on the device is read next on another stream: complete first
                self.run_stream.synchronize()
            return host

    def _capture(self, feed, cache_of, key, keep=frozenset()):
        """This step run eagerly (its outputs are returned: they are the step's results), then
        the same walk captured, not run. An error of the eager run is the step's own: raised."""
        cp = self.backend.cp
        self.graph = self.outs = self.statics = self.pool = None  # the old capture goes
        pool = cp.cuda.MemoryPool()  # the graph's own: see the module's docstring
        cap = cp.cuda.Stream(non_blocking=True)  # capture cannot run on the legacy stream
        # replays run on a blocking stream: ordered after the eager work queued on the legacy one
        self.run_stream = cp.cuda.Stream(non_blocking=False)
        self.backend.device.synchronize()  # the capture stream does not wait on the legacy one
        with cp.cuda.using_allocator(pool.malloc), cap:
            statics = {i: cp.asarray(np.ascontiguousarray(feed[name])) for i, name in self.inputs}
            host = [v if i in keep else cp.asnumpy(v, stream=cap)
                    for i, v in enumerate(self.cg.walk(feed, cache_of, statics))]
            if keep:  # the kept values are read next on another stream
                cap.synchronize()
            try:
                cap.begin_capture()
                try:
                    outs = self.cg.walk(feed, cache_of, statics)
                finally:
                    graph = cap.end_capture()
            except Exception as e:  # an op that syncs with the host, say: eager from now on
                self.failed = True
                log.warning("this step shape runs without a CUDA graph", error=f"{type(e).__name__}: {e}")
                return host
        self.graph, self.outs, self.statics, self.key, self.pool = graph, outs, statics, key, pool
        self.counters["captures"] += 1
        return host
