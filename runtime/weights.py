"""The weights' lifecycle, in one place: model parameters as they sit in the GGUF file
(QWeight: mmap'd, not copied); q/k/v stacked into one matrix where fusion asks
(`stacked_weight`); prepared once per backend (`WeightStore`: packed, uploaded), or mapped
from the packed-weight cache on disk (`weight_cache.WeightCache`, for backends that export
their prepared weights); and the file's pages dropped from memory once a backend holds its
own copy (`release_pages`, called by the packers as they go)."""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
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


# ---- the packed-weight cache on disk ----------------------------------------------------
# One file per (model file, backend): a fixed head, a JSON index, then each array at a
# 64-byte aligned offset. Mapped copy-on-write (MAP_PRIVATE): the arrays are writable numpy
# arrays (kernels compiled for writable ones serve them) whose pages stay the file's, shared
# between processes and evictable, as long as nothing writes them (nothing does).
CACHE_MAGIC = b"HLWCACHE"
CACHE_FORMAT = 1       # of the file itself; the backend's `weight_layout` versions its contents
_HEAD = struct.Struct("<8sIIQQQ")  # magic, format, 0, index bytes, data offset, file bytes
_ALIGN = 64
ENV_CACHE_DIR = "HEARTHLM_CACHE_DIR"  # a directory, or "off"


def default_cache_dir() -> Path:
    """hearthlm's cache directory by the platform's convention (numba's cache sits there too
    when it cannot write beside its sources)."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hearthlm"


def cache_dir(option: str | os.PathLike | bool | None = None) -> Path | None:
    """Where packed weights go: `option` a directory, False (or "off") for none, None for
    $HEARTHLM_CACHE_DIR or the platform's default."""
    if option is None:
        option = os.environ.get(ENV_CACHE_DIR) or True
    if option is False or (isinstance(option, str) and option.lower() in ("off", "0", "none", "")):
        return None
    return (default_cache_dir() if option is True else Path(option)) / "weights"


def _checksum(a: np.ndarray) -> int:
    """A 64-bit wrapping sum of the bytes as little-endian words (regions are padded to 64
    bytes with zeros): at memory speed, where crc32 (~0.9 GB/s) would add 0.1-0.3 s to a start."""
    return int(np.add.reduce(a.view("<u8"), dtype=np.uint64)) if a.size else 0


class WeightCache:
    """Prepared weights of one model file, per backend, on disk. `identity` (the file's path,
    size, mtime and a hash of its header and tensor table) is stored inside and must match;
    so must the backend's `weight_layout`. A file that does not match is stale, one that fails
    a check (magic, format, lengths, index, checksums) corrupt: both are rebuilt, never used.
    Writing goes to a temporary file renamed into place, so readers see an old file or a
    whole new one; a directory that cannot be written means no cache, nothing worse."""

    def __init__(self, directory: Path, identity: dict) -> None:
        self.directory, self.identity = Path(directory), identity
        self.problem: str | None = None  # why the last load or save found no usable file

    def path(self, backend) -> Path:
        key = hashlib.sha256(f"{self.identity['path']}|{backend.name}".encode()).hexdigest()[:24]
        return self.directory / f"{key}.{backend.name}.hlw"

    def load(self, backend) -> tuple[dict[str, tuple[dict, dict[str, np.ndarray]]], str]:
        """({name: (meta, arrays)}, state): state "hit", "miss", "stale" or "corrupt"."""
        path = self.path(backend)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _HEAD.size:
                    return self._bad("corrupt", path, "shorter than its head")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            return {}, "miss"
        except (OSError, ValueError) as e:
            return self._bad("corrupt", path, f"cannot map: {e}")
        buf = np.frombuffer(mm, np.uint8)
        magic, fmt, _, n_index, data_at, n_file = _HEAD.unpack_from(mm, 0)
        if magic != CACHE_MAGIC:
            return self._bad("corrupt", path, "bad magic")
        if fmt != CACHE_FORMAT:
            return self._bad("stale", path, f"format {fmt}")
        if n_file != size or not _HEAD.size + n_index <= data_at <= size:
            return self._bad("corrupt", path, "lengths do not match the file")
        try:
            index = json.loads(bytes(mm[_HEAD.size:_HEAD.size + n_index]))
            if index["identity"] != self.identity or index["layout"] != backend.weight_layout:
                return self._bad("stale", path, "made from another file or layout")
            out = {}
            for name, (meta, arrays) in index["weights"].items():
                got = {}
                for k, (dtype, shape, rel, nbytes, chk) in arrays.items():
                    dt, n = np.dtype(dtype), int(np.prod(shape, dtype=np.int64))
                    span, off = -(-nbytes // _ALIGN) * _ALIGN, data_at + rel
                    if rel % _ALIGN or rel < 0 or off + span > size or n * dt.itemsize != nbytes or dt.hasobject:
                        return self._bad("corrupt", path, f"{name}.{k}: bad extent")
                    region = buf[off:off + span]
                    if _checksum(region) != chk:
                        return self._bad("corrupt", path, f"{name}.{k}: checksum mismatch")
                    got[k] = region[:nbytes].view(dt).reshape(shape)
                out[name] = (meta, got)
        except (ValueError, KeyError, TypeError) as e:  # a damaged index
            return self._bad("corrupt", path, f"bad index: {type(e).__name__}: {e}")
        self.problem = None
        return out, "hit"

    def _bad(self, state: str, path: Path, why: str):
        self.problem = f"{path}: {why}"
        return {}, state

    def save(self, backend, entries: dict[str, tuple[dict, dict[str, np.ndarray]]]) -> bool:
        """Write `entries` ({name: (meta, arrays)}) as the backend's file; False if it cannot."""
        index: dict[str, Any] = dict(identity=self.identity, layout=backend.weight_layout, weights={})
        off, plan = 0, []
        for name, (meta, arrays) in entries.items():
            rec = {}
            for k, a in arrays.items():
                a = np.ascontiguousarray(a)
                span = -(-a.nbytes // _ALIGN) * _ALIGN
                rec[k] = [a.dtype.str, list(a.shape), off, a.nbytes, 0]
                plan.append((rec[k], a, span))
                off += span
            index["weights"][name] = [meta, rec]
        for r, a, span in plan:  # checksums are of the padded regions, as load reads them
            region = np.zeros(span, np.uint8)
            region[:a.nbytes] = a.reshape(-1).view(np.uint8)
            r[4] = _checksum(region)
        raw = json.dumps(index, separators=(",", ":")).encode()
        data_at = -(-(_HEAD.size + len(raw)) // mmap.PAGESIZE) * mmap.PAGESIZE  # offsets in the index are from here
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(CACHE_MAGIC, CACHE_FORMAT, 0, len(raw), data_at, data_at + off))
                f.write(raw)
                f.write(b"\0" * (data_at - _HEAD.size - len(raw)))
                for r, a, span in plan:
                    f.write(a.reshape(-1).view(np.uint8).data)
                    f.write(b"\0" * (span - a.nbytes))
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep it from other users' processes
            os.replace(tmp, self.path(backend))
            return True
        except OSError as e:  # read-only or full: run without the cache
            self.problem = f"{self.directory}: cannot write the weight cache: {e}"
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return False
