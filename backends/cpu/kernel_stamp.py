"""Where numba keeps the CPU kernels it compiled, and when it must compile them again.

numba's cache keys a compiled function by its own source file only, but a cached function holds
the code of every jitted function it calls, linked in: after an edit to dot.py, matmul.py's cached
`_matvec` kept running the old dot kernels (a prefetch experiment measured nothing that way). For
functions in KERNEL_DIRS the stamp is a digest of the contents of every module in their folder, so
any change there recompiles them all.

numba also files its cache by the source's path (beside it in __pycache__, or under a hash of the
path), so every clone, checkout or virtual environment compiled the kernels again: ~15 of the test
suite's ~32 minutes in a clean clone here. Kernel folders are cached by content instead, in
`<cache dir>/kernels/<folder>-<digest>` (`$HEARTHLM_KERNEL_CACHE_DIR`, else hearthlm's cache
directory: `$HEARTHLM_CACHE_DIR` or the platform's), shared by every copy of the same sources on
the machine; numba's index still tells CPUs and signatures apart. `NUMBA_CACHE_DIR` keeps numba's
own layout (a test's or a benchmark's cold start); where neither can be written, __pycache__.
Installed before the first cached function is decorated (this package's __init__)."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from numba.core import caching

from hearthlm.core.cache_dirs import cache_dir, turned_off

KERNEL_DIRS: set[Path] = {Path(__file__).resolve().parent}
ENV_KERNEL_CACHE_DIR = "HEARTHLM_KERNEL_CACHE_DIR"  # a directory, or "off" (numba's own places)
KEEP_VERSIONS = 8        # content versions kept per folder: an edit makes a new one
PRUNE_AFTER_S = 3600.0   # and none is removed that was used this recently (another process's)
_digests: dict[Path, str] = {}
_prepared: set[Path] = set()


def dir_stamp(folder: Path) -> str:
    """A digest of the names and contents of the folder's modules; kept per process (a module
    edited while a process runs is not reloaded by it either)."""
    folder = folder.resolve()
    if folder not in _digests:
        h = hashlib.sha256()
        for p in sorted(folder.glob("*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        _digests[folder] = h.hexdigest()
    return _digests[folder]


def kernel_cache_root() -> Path | None:
    """The folder that holds content-addressed kernel caches; None when turned off."""
    env = os.environ.get(ENV_KERNEL_CACHE_DIR)
    if env is not None:
        return None if turned_off(env) else Path(env)
    return cache_dir(kind="kernels")


def prune(root: Path, name: str, keep: int = KEEP_VERSIONS, idle_s: float = PRUNE_AFTER_S) -> list[Path]:
    """Remove `name`'s versions past the `keep` most recently used, unless used within `idle_s`
    (a process running other sources may still be writing there); returns what it removed."""
    versions = sorted(root.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    now, gone = time.time(), []
    for p in versions[keep:]:
        if now - p.stat().st_mtime > idle_s:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def _with_siblings(base):
    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent not in KERNEL_DIRS:
                return None  # numba's own locators take it
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return dir_stamp(Path(self._py_file).parent)
    Locator.__name__ = Locator.__qualname__ = "Sibling" + base.__name__
    return Locator


class SharedCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """A kernel folder's functions in `<root>/<folder name>-<digest of its modules>`."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        folder = Path(py_file).resolve().parent
        self._cache_path = str(kernel_cache_root() / f"{folder.name}-{dir_stamp(folder)[:24]}")

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        return dir_stamp(Path(self._py_file).parent)

    @classmethod
    def from_function(cls, py_func, py_file):
        folder = Path(py_file).resolve().parent
        if folder not in KERNEL_DIRS or kernel_cache_root() is None:
            return None
        self = super().from_function(py_func, py_file)  # None where it cannot be written
        if self is not None and folder not in _prepared:
            _prepared.add(folder)
            try:
                os.utime(self._cache_path)  # this version is in use
                prune(Path(self._cache_path).parent, folder.name)
            except OSError:
                pass
        return self


def install() -> None:
    """Put the content-stamped locators first: NUMBA_CACHE_DIR's (numba's layout), the shared
    content-addressed one, then __pycache__."""
    classes = caching.CacheImpl._locator_classes
    if any(c.__name__.startswith("Sibling") for c in classes):
        return
    classes[:0] = [_with_siblings(caching.UserProvidedCacheLocator), SharedCacheLocator,
                   _with_siblings(caching.InTreeCacheLocator)]
