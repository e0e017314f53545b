"""numba's cache keys a compiled function by its own source file's stamp only, but a cached
function holds the code of every jitted function it calls, linked in: after an edit to dot.py,
matmul.py's cached `_matvec` kept running the old dot kernels (a prefetch experiment measured
nothing that way). For functions in KERNEL_DIRS the stamp is their file's and the stamps of every
module beside it, so any change there recompiles them all. Installed before the first cached
function is decorated (this package's __init__)."""
from __future__ import annotations

from pathlib import Path

from numba.core import caching

KERNEL_DIRS: set[Path] = {Path(__file__).resolve().parent}
_digests: dict[Path, tuple] = {}


def dir_stamp(folder: Path) -> tuple:
    """(name, mtime, size) of each module in the folder, as numba stamps one file; kept per process
    (a module edited while a process runs is not reloaded by it either)."""
    if folder not in _digests:
        _digests[folder] = tuple(sorted((p.name, (st := p.stat()).st_mtime, st.st_size) for p in folder.glob("*.py")))
    return _digests[folder]


def _with_siblings(base):
    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent not in KERNEL_DIRS:
                return None  # numba's own locators take it
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return super().get_source_stamp(), dir_stamp(Path(self._py_file).resolve().parent)
    Locator.__name__ = Locator.__qualname__ = "Sibling" + base.__name__
    return Locator


def install() -> None:
    """Put the sibling-stamped locators first (UserProvided: NUMBA_CACHE_DIR; InTree: __pycache__)."""
    classes = caching.CacheImpl._locator_classes
    if any(c.__name__.startswith("Sibling") for c in classes):
        return
    ours = [_with_siblings(c) for c in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator)]
    classes[:0] = ours
