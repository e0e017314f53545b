"""Backends run graph nodes: `reference` (numpy, ground truth), `cpu` (numba), `cuda` (CuPy).
Each is a core.backend.Backend, named in the registry below and imported only when opened
(numba's and CuPy's import costs are paid by whoever uses them)."""
from __future__ import annotations

import importlib

from hearthlm.core.errors import BackendError

# name -> "module:class"
REGISTRY = {
    "cpu": "hearthlm.backends.cpu.backend:CPUBackend",
    "reference": "hearthlm.backends.reference:ReferenceBackend",
    "cuda": "hearthlm.backends.cuda.backend:CUDABackend",
}
BACKENDS = tuple(REGISTRY)


def get_backend(name: str):
    """A new backend of this name."""
    if name not in REGISTRY:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()
