"""Model parameters as they sit in the GGUF file (mmap'd, not copied). Backends turn a
QWeight into their own layout once, with `Backend.prepare_weight`."""
from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class QWeight:
    name: str              # GGUF tensor name, e.g. "blk.0.attn_q.weight"
    ggml_type: int         # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for matrices, (n,) for vectors
    raw: np.ndarray        # uint8 (n_rows, row_bytes), read-only view of the file

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


_libc = None


def release_pages(a: np.ndarray) -> None:
    """Drop the resident pages of a read-only view of the model file, once a backend holds its
    own copy of them: otherwise the file's copy stays in the process's RSS beside the packed one.
    Pages touched again are read back from the page cache. Nothing happens for arrays that are
    not a file's memmap (dropping anonymous pages would zero them)."""
    global _libc
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED") or a.nbytes == 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    start = a.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(a.ctypes.data + a.nbytes - start), mmap.MADV_DONTNEED)
