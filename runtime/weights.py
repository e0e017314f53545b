"""The weights' lifecycle, in one place: model parameters as they sit in the GGUF file
(QWeight: mmap'd, not copied); q/k/v stacked into one matrix where fusion asks
(`stacked_weight`); prepared once per backend (`WeightStore`: packed, uploaded), or mapped
from the packed-weight cache on disk (`weight_cache.WeightCache`, for backends that export
their prepared weights); and the file's pages dropped from memory once a backend holds its
own copy (`release_pages`, called by the packers as they go)."""
from __future__ import annotations

import ctypes
import mmap
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hearthlm.runtime.log import get_logger

log = get_logger("hearthlm.weights")

@dataclass(frozen=True, eq=False)
class QWeight:
    name: str              # GGUF tensor name, e.g. "blk.0.attn_q.weight"
    ggml_type: int         # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for matrices, (n,) for vectors
    raw: np.ndarray = field(repr=False)  # uint8 (n_rows, row_bytes), read-only view of the file

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


_stacked: "weakref.WeakKeyDictionary[QWeight, dict]" = weakref.WeakKeyDictionary()


def stacked_weight(ws: list[QWeight]) -> QWeight:
    """One weight holding the rows of `ws` in order (made once per tuple of weights)."""
    per_first = _stacked.setdefault(ws[0], {})
    key = tuple(id(w) for w in ws)
    if key not in per_first:
        per_first[key] = StackedWeight(tuple(ws))
    return per_first[key]


def _exports(backend) -> bool:
    """Whether the backend's prepared weights can go to disk and back: it names a layout, and
    the class that prepares weights also imports them (a subclass that changes prepare_weight
    alone would get its parent's imports back)."""
    owner = lambda attr: next(k for k in type(backend).__mro__ if attr in vars(k))  # noqa: E731
    return bool(backend.weight_layout) and owner("prepare_weight") is owner("import_weight")


class WeightStore:
    """Prepared (packed/uploaded) weights of one backend, each made once, on first use: the
    graph cache binds weights when it compiles a graph, so the engine's load-time compile of
    the decode graph packs what decoding reads. With a `cache` (weight_cache.WeightCache) and
    a backend that exports its weights, those found in the cache file are mapped from it, and
    `persist` writes the file when some had to be prepared afresh."""

    def __init__(self, backend, cache=None) -> None:
        self.backend = backend
        self.cache = cache if cache is not None and _exports(backend) else None
        self._prepared: dict[str, Any] = {}
        self._weights: dict[str, QWeight] = {}
        self._fresh = 0  # weights prepared from the model file, not mapped from the cache
        self._mapped, self.cache_state = self.cache.load(backend) if self.cache else ({}, "off")
        if self.cache_state in ("stale", "corrupt"):  # rebuilt by persist
            log.info("weight_cache_rebuild", state=self.cache_state, problem=self.cache.problem)

    def get(self, w: QWeight) -> Any:
        p = self._prepared.get(w.name)
        if p is None:
            hit = self._mapped.get(w.name)
            if hit is not None and hit[0].get("_type") == int(w.ggml_type) and tuple(hit[0].get("_shape")) == w.shape:
                p = self.backend.import_weight(hit[0], hit[1])
            else:
                p = self.backend.prepare_weight(w)
                if self.cache is not None and self.backend.export_weight(p) is not None:
                    self._fresh += 1  # one the file should hold (not a view of the model file)
            self._prepared[w.name], self._weights[w.name] = p, w
        return p

    def persist(self) -> bool:
        """Write the cache file if weights were prepared afresh, then serve every weight from
        it (the packed copies in memory go; the file's pages are shared and evictable). True
        when the prepared values changed: graphs bound to the old ones must rebind."""
        if self.cache is None or not self._fresh:
            return False
        entries = {}
        for name, p in self._prepared.items():
            e = self.backend.export_weight(p)
            if e is not None:
                w = self._weights[name]
                entries[name] = (dict(e[0], _type=int(w.ggml_type), _shape=list(w.shape)), e[1])
        self._fresh = 0
        if not self.cache.save(self.backend, entries):
            log.warning("weight_cache_unwritable", problem=self.cache.problem)
            self.cache_state = "unwritable"
            return False
        self._mapped, state = self.cache.load(self.backend)
        if state != "hit":
            return False
        self.cache_state = "written"
        self._prepared = {n: p for n, p in self._prepared.items() if n not in self._mapped}
        return True

    def __len__(self) -> int:
        return len(self._prepared)
