"""hearthlm's cache folders on disk: packed weights, persisted prompts and compiled CPU kernels
each go to a folder of their kind under one root, $HEARTHLM_CACHE_DIR or the platform's cache
directory. Here, on the lowest floor, because the CPU backend's kernel cache uses it too."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_CACHE_DIR = "HEARTHLM_CACHE_DIR"  # a directory, or "off"


def default_cache_dir() -> Path:
    """hearthlm's cache directory by the platform's convention."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hearthlm"


def turned_off(option) -> bool:
    """Whether a cache option or environment value means "no cache" (False, "off", "0", "none", "")."""
    return option is False or (isinstance(option, str) and option.lower() in ("off", "0", "none", ""))


def cache_dir(option: str | os.PathLike | bool | None = None, kind: str = "weights") -> Path | None:
    """Where packed weights (kind "weights"), persisted prompts ("prompts") or compiled kernels
    ("kernels") go: a folder of `option` (a directory), none for False (or "off"), or of
    $HEARTHLM_CACHE_DIR or the platform's default for None."""
    if option is None:
        option = os.environ.get(ENV_CACHE_DIR) or True
    if turned_off(option):
        return None
    return (default_cache_dir() if option is True else Path(option)) / kind
