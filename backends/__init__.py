"""Backends run graph nodes: `reference` (numpy, ground truth), `cpu` (numba), `cuda` (CuPy)."""
from __future__ import annotations

from hearthlm.runtime.errors import BackendError

BACKENDS = ("cpu", "reference")


def get_backend(name: str):
    if name == "cpu":
        from hearthlm.backends.cpu.backend import CPUBackend
        return CPUBackend()
    if name == "reference":
        from hearthlm.backends.reference import ReferenceBackend
        return ReferenceBackend()
    raise BackendError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
