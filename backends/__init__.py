"""Backends run graph nodes: `reference` (numpy, ground truth), `cpu` (numba), `cuda` (CuPy)."""
from __future__ import annotations

from hearthlm.runtime.errors import BackendError

BACKENDS = ("cpu", "reference", "cuda")


def get_backend(name: str):
    if name == "cpu":
        from hearthlm.backends.cpu.backend import CPUBackend
        return CPUBackend()
    if name == "reference":
        from hearthlm.backends.reference import ReferenceBackend
        return ReferenceBackend()
    if name == "cuda":
        from hearthlm.backends.cuda.backend import CUDABackend
        return CUDABackend()
    raise BackendError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
