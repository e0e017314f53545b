"""The packed-weight cache on disk: a backend's prepared weights of one model file, written
once and mapped at later starts instead of packed again (runtime.weights.WeightStore reads
and fills it)."""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

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
