"""Weight records: model parameters as they sit in the GGUF file (QWeight: mmap'd, not
copied; `RowTable` those read only by row); q/k/v stacked into one matrix where fusion asks (`stacked_weight`); and the file's
pages dropped from memory once a backend holds its own copy (`release_pages`, called by the
packers as they go). Backends prepare them (runtime.weights.WeightStore)."""
from __future__ import annotations

import ctypes
import mmap
import weakref
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class QWeight:
    name: str              # GGUF tensor name, e.g. "blk.0.attn_q.weight"
    ggml_type: int         # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for matrices, (n,) for vectors
    raw: np.ndarray = field(repr=False)  # uint8 (n_rows, row_bytes), read-only view of the file

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


@dataclass(frozen=True, eq=False)
class RowTable(QWeight):
    """A table read only by row (get_rows: Gemma 4's per-layer embeddings, 262,144 x 8,960 in E2B): a
    backend may leave it in the file and read the rows a step asks for (llama.cpp's TENSOR_READ_LAZY)."""


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


class StackedWeight(QWeight):
    """The rows of several weights in order. `raw` is made on each read (a backend reads it
    once, to prepare it): kept, the copy would stay in memory beside the prepared one, and a
    backend that maps its prepared weight from the disk cache never reads it at all."""

    def __init__(self, parts: tuple[QWeight, ...]) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        set_("parts", parts)
        set_("name", "+".join(w.name for w in parts))
        set_("ggml_type", parts[0].ggml_type)
        set_("shape", (sum(w.shape[0] for w in parts), parts[0].shape[1]))

    @property
    def raw(self) -> np.ndarray:  # type: ignore[override]
        out = np.concatenate([w.raw for w in self.parts])
        for w in self.parts:  # the stacked copy is what backends pack
            release_pages(w.raw)
        return out

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.parts)


# held weakly: whoever packs a stack keeps it. (A WeakKeyDictionary on the first weight, its value
# holding that key, kept every model's weights and file mapping for ever.) The parts' ids are a safe
# key: a live stack holds its parts, so their ids are not reused while its entry lasts.
_stacked: "weakref.WeakValueDictionary[tuple[int, ...], StackedWeight]" = weakref.WeakValueDictionary()


def stacked_weight(ws: list[QWeight]) -> QWeight:
    """One weight holding the rows of `ws` in order (made once per tuple of weights)."""
    key = tuple(id(w) for w in ws)
    got = _stacked.get(key)
    if got is None:
        got = _stacked[key] = StackedWeight(tuple(ws))
    return got
