"""The packed-weight cache on disk: a backend's prepared weights of one model file, written
once and mapped at later starts instead of packed again (runtime.weights.WeightStore reads
and fills it)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from hearthlm.core.cache_dirs import ENV_CACHE_DIR, cache_dir, default_cache_dir  # noqa: F401  (re-exported)
from hearthlm.runtime import array_file

# One file per (model file, backend), in runtime.array_file's format. A file under PRIVATE_UNDER
# of the memory available is read into huge pages of the process's own (1-token steps 8-13%
# shorter: array_file.HUGE_PAGES); a larger one is mapped copy-on-write (MAP_PRIVATE), its pages the
# file's, shared between processes and evictable, as long as nothing writes them (nothing does).
# Available, not installed: each model read privately leaves less for the next (a server's several
# models), and a file that would crowd the machine stays evictable. Either way the arrays are
# writable numpy arrays (kernels compiled for writable ones serve them).
CACHE_MAGIC = b"HLWCACHE"
CACHE_FORMAT = 2       # of the file itself; the backend's `weight_layout` versions its contents
PRIVATE_UNDER = 1 / 4  # of the memory available: larger files stay shared mappings


def _available_memory() -> int:
    """Linux's MemAvailable in bytes; 0 where it cannot be read (no huge pages asked for there)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


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
            private = path.stat().st_size <= PRIVATE_UNDER * _available_memory()
            index, arrays = array_file.read(path, CACHE_MAGIC, CACHE_FORMAT, private=private)
        except FileNotFoundError:
            return {}, "miss"
        except OSError as e:
            return self._bad("corrupt", path, f"cannot read: {e}")
        except array_file.ArrayFileError as e:
            return self._bad(e.state, path, str(e))
        if index.get("identity") != self.identity or index.get("layout") != backend.weight_layout:
            return self._bad("stale", path, "made from another file or layout")
        try:
            out = {name: (meta, {k: arrays[f"{name}|{k}"] for k in keys})
                   for name, (meta, keys) in index["weights"].items()}
        except (ValueError, KeyError, TypeError) as e:
            return self._bad("corrupt", path, f"bad index: {type(e).__name__}: {e}")
        self.problem = None
        return out, "hit"

    def _bad(self, state: str, path: Path, why: str):
        self.problem = f"{path}: {why}"
        return {}, state

    def save(self, backend, entries: dict[str, tuple[dict, dict[str, np.ndarray]]]) -> bool:
        """Write `entries` ({name: (meta, arrays)}) as the backend's file; False if it cannot."""
        index = dict(identity=self.identity, layout=backend.weight_layout,
                     weights={name: [meta, list(arrays)] for name, (meta, arrays) in entries.items()})
        flat = {f"{name}|{k}": a for name, (_, arrays) in entries.items() for k, a in arrays.items()}
        try:
            array_file.write(self.path(backend), CACHE_MAGIC, CACHE_FORMAT, index, flat)
        except OSError as e:  # read-only or full: run without the cache
            self.problem = f"{self.directory}: cannot write the weight cache: {e}"
            return False
        self.prune(backend)
        return True

    def prune(self, backend) -> list[Path]:
        """Drops the backend's other files here whose model file is gone or has changed since
        (its recorded path, size and mtime), or that this version can no longer read: each is
        about its model's size, and nothing else would ever remove it. Returns what it dropped.
        A file in use elsewhere stays readable there (unlinking leaves its mapping); one that
        cannot be removed is left."""
        dropped, own = [], self.path(backend)
        for path in self.directory.glob(f"*.{backend.name}.hlw"):
            if path == own:
                continue
            try:
                index, _ = array_file.read(path, CACHE_MAGIC, CACHE_FORMAT, arrays=False)
                ident = index["identity"]
                st = os.stat(ident["path"])
                if (st.st_size, st.st_mtime_ns) == (ident["size"], ident["mtime_ns"]) and \
                        index.get("layout") == backend.weight_layout:
                    continue
            except FileNotFoundError:  # its model is gone (or it went meanwhile)
                pass
            except OSError:  # unreadable for now: not ours to judge
                continue
            except (array_file.ArrayFileError, KeyError, TypeError):  # another format, or corrupt
                pass
            try:
                path.unlink()
                dropped.append(path)
            except OSError:
                pass
        return dropped
