"""The .cu kernel sources and their compiled modules. Local `#include "x.cuh"` lines are
inlined here, so NVRTC compiles one self-contained string and CuPy's kernel cache (keyed
by the source text) sees a header change. No cupy import at module level."""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
CU_FILES = ("matmul.cu", "norm_rope.cu", "attention.cu", "ssm.cu", "delta_net.cu")
OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def source(name: str, _seen: set[str] | None = None) -> str:
    """The text of kernels/`name` with local includes inlined, each header once."""
    seen = set() if _seen is None else _seen
    seen.add(name)
    text = (KERNEL_DIR / name).read_text()

    def inline(m: re.Match) -> str:
        header = m.group(1)
        return "" if header in seen else source(header, seen)
    return _INCLUDE.sub(inline, text).replace("#pragma once", "")


@lru_cache(maxsize=None)
def module(name: str):
    """The compiled cupy.RawModule of kernels/`name` (compiled once per process; CuPy also
    caches the binary on disk)."""
    import cupy
    return cupy.RawModule(code=source(name), options=OPTIONS)


def kernel(file: str, fn: str):
    return _kernel(file, fn)


@lru_cache(maxsize=None)
def _kernel(file: str, fn: str):
    return module(file).get_function(fn)
