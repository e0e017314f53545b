"""The Backend protocol, as a base class every backend derives from: what runtime calls,
and the optional capabilities with their defaults, so runtime never probes with getattr.
A backend runs one graph node at a time (`kernels[op](node, *srcs, out=None)`, bound to
its node once per compiled graph by `bind`) on values it owns; `runtime.dispatch` walks the
graph. Backends import nothing of ours but core."""
from __future__ import annotations

import functools
import mmap
from typing import Any, Callable

import numpy as np

from hearthlm.core import array_ops
from hearthlm.core.graph import Op, Tensor
from hearthlm.core.weights import QWeight

Kernel = Callable[..., Any]  # kernel(node, *src_values[, out=buffer]) -> value

# the kinds of a compiled graph's steps (runtime.dispatch), read by a backend's graph_runner:
# an input's upload, a prepared weight, a cache lookup, a copy between backends, a kernel, a view
INPUT, STATIC, CACHE, COPY, KERNEL, VIEW = "input", "static", "cache", "copy", "kernel", "view"


# A host KV cache (or recurrent state) is written a block at a time as requests come, so its
# pages fault in inside the steps that first write them: in 4 KiB pages, not the 2 MiB ones numpy
# asks for from 4 MB. On a VM whose free memory goes back to the host, a fresh huge page costs the
# host's faults on all of it (runtime.array_file): measured on a 2-core Firecracker guest, 512-token
# prefills of Gemma 3 took up to 1 s longer, their K/V writes 88 ms on average against 3 ms.
# What huge pages would give attention's reads (fewer TLB misses) measured within the noise.
HOST_LAZY_MIN = 4 << 20  # bytes: numpy's own threshold for asking for huge pages


def host_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros in host memory that is taken only as it is written, in 4 KiB pages."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n < HOST_LAZY_MIN or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero pages, faulted in when written
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, dtype).reshape(shape)  # the array holds the mapping


class Backend:
    name: str = ""
    kernels: dict[Op, Kernel]          # op -> kernel; an op missing here is not supported
    weight_types: frozenset[int] = frozenset()  # ggml types prepare_weight takes

    # ---- optional capabilities (the defaults suit a host backend that allocates) ----
    plans_memory: bool = False         # kernels take out= buffers placed in one host arena
    kv_dtype: np.dtype = np.dtype(np.float32)  # element type of the K/V cache it holds
    weight_layout: str | None = None   # names (and versions) what export_weight gives: set, the
    #                                    packed-weight cache on disk keeps this backend's weights

    def prepare_weight(self, w: QWeight) -> Any:
        """Repack/upload a weight once; the result is what kernels receive for WEIGHT nodes."""
        raise NotImplementedError

    def export_weight(self, prepared: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """A prepared weight as (JSON-able metadata, named host arrays) for the disk cache; None
        for one not worth keeping (a view of the model file, say). Needs `weight_layout`."""
        return None

    def import_weight(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        """The prepared weight again, from what export_weight gave (arrays now mapped from the
        cache file: writable, but their pages are the file's only while nothing writes them)."""
        raise NotImplementedError

    def bind(self, node: Tensor) -> Callable[..., Any]:
        """node's kernel as call(*src_values[, out=buffer]), made once when a graph is compiled: a
        backend binds its hot kernels with what they read of the node (params, the kernel variant
        its fixed shape picks) so that a step does not read them again; by default the node is
        passed along."""
        return functools.partial(self.kernels[node.op], node)

    def supports(self, node: Tensor) -> bool:
        """Whether this backend can run `node` (its op, and a weight's type)."""
        if node.op is Op.WEIGHT:
            return int(node.params["weight"].ggml_type) in self.weight_types
        return node.op in self.kernels or node.op in (Op.INPUT, Op.CACHE)

    def to_host(self, value: Any) -> np.ndarray:
        """A numpy array of a value (identity on host backends)."""
        return value

    def from_host(self, array: np.ndarray) -> Any:
        """A numpy array placed where this backend's kernels read it."""
        return array

    def argmax_rows(self, value: Any) -> np.ndarray:
        """Each row's index of its largest value (numpy's argmax: the first of equal ones, a NaN
        before any number), as a host int array: greedy tokens taken where the logits are, so
        that a device copies back ids, not a vocabulary of floats per row."""
        return np.asarray(self.to_host(value)).argmax(axis=1)

    def top_k_rows(self, value: Any, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's ks[i] largest entries, where the logits are, as host arrays (ids, values,
        ok): core.array_ops.top_k_rows's contract. Sampled steps copy back k candidates a row,
        not a vocabulary of floats, and the rows' top-k runs where the logits are."""
        return array_ops.top_k_rows(np.asarray(self.to_host(value)), ks, np)

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A zero-filled buffer of this backend's (the KV cache), made where it lives."""
        return self.from_host(host_zeros(shape, dtype))

    def copy_from(self, src: "Backend", value: Any) -> Any:
        """A value of backend `src` as one of this backend's own: a round trip through host
        memory by default (a device backend overrides it with an async copy). Always a new
        buffer: the source's may go back to its arena at once."""
        v = self.from_host(src.to_host(value))
        return v.copy() if v is value else v

    def memory_available(self) -> int | None:
        """Bytes this backend's buffers (the KV cache) can still take; None if unknown. Host
        memory by default: the kernel's MemAvailable."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def bind_thread(self) -> None:
        """Called in the engine's worker thread before it runs any kernel (a GPU backend
        makes its device current there: kernels run in that thread, not the caller's)."""

    def thread_counts(self) -> tuple[int, ...]:
        """Worker-thread counts the engine may choose between, step by step (runtime.threads
        measures which is fastest now: on a CPU shared with other work, fewer threads than
        cores). Empty: the backend's own choice, untuned."""
        return ()

    def use_threads(self, n: int) -> None:
        """Run the calling thread's next kernels on n worker threads (one of thread_counts);
        called before each step."""

    def after_step(self, n: int | None, slow: bool) -> bool:
        """Called after each step run on n threads; slow: runtime.threads found it far slower
        than its count's mean. True if the backend moved its workers (backends/cpu/affinity.py),
        so that the engine measures the thread counts afresh."""
        return False

    def graph_runner(self, cg) -> Callable[..., Any] | None:
        """For a compiled graph that runs on this backend alone: a callable
        `runner(feed, cache_of, keep) -> outputs | None` that dispatch.execute tries before walking
        the steps (None from it: walk them), or None for none; outputs at the positions in `keep`
        stay this backend's values, complete when it returns, the others come back as numpy arrays. A GPU backend replays the
        captured step (backends/cuda/graphs.py): one launch instead of one per kernel."""
        return None

    def loaded(self) -> None:
        """Called once the weights a session needs at start are prepared (a GPU backend
        frees its upload staging memory)."""
