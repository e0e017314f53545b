"""The weights' lifecycle, in one place: model parameters as they sit in the GGUF file
(QWeight: mmap'd, not copied); q/k/v stacked into one matrix where fusion asks
(`stacked_weight`); prepared once per backend (`WeightStore`: packed, uploaded); and the
file's pages dropped from memory once a backend holds its own copy (`release_pages`, called
by the packers as they go)."""
from __future__ import annotations

import ctypes
import mmap
import weakref
from dataclasses import dataclass
from typing import Any

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


_stacked: "weakref.WeakKeyDictionary[QWeight, dict]" = weakref.WeakKeyDictionary()


def stacked_weight(ws: list[QWeight]) -> QWeight:
    """One weight holding the rows of `ws` in order (made once per tuple of weights)."""
    per_first = _stacked.setdefault(ws[0], {})
    key = tuple(id(w) for w in ws)
    if key not in per_first:
        per_first[key] = QWeight("+".join(w.name for w in ws), ws[0].ggml_type,
                                 (sum(w.shape[0] for w in ws), ws[0].shape[1]), np.concatenate([w.raw for w in ws]))
        for w in ws:  # read once, here: the stacked copy is what backends pack
            release_pages(w.raw)
    return per_first[key]


class WeightStore:
    """Prepared (packed/uploaded) weights of one backend, each made once, on first use: the
    graph cache binds weights when it compiles a graph, so the engine's load-time compile of
    the decode graph packs what decoding reads."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._prepared: dict[str, Any] = {}

    def get(self, w: QWeight) -> Any:
        p = self._prepared.get(w.name)
        if p is None:
            p = self._prepared[w.name] = self.backend.prepare_weight(w)
        return p

    def __len__(self) -> int:
        return len(self._prepared)
