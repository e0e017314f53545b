"""Reading architecture hyperparameters from GGUF metadata with errors that name the key."""
from __future__ import annotations

from typing import Any, Mapping

from hearthlm.runtime.errors import ModelLoadError


def need(md: Mapping[str, Any], key: str, kind: type = int) -> Any:
    """A required positive number (int, or float with kind=float)."""
    if key not in md:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return _number(key, md[key], kind)


def opt(md: Mapping[str, Any], key: str, default: Any, kind: type = int) -> Any:
    """An optional positive number, `default` when absent."""
    return _number(key, md[key], kind) if key in md else default


def _number(key: str, v: Any, kind: type) -> Any:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok:
        raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be {'a number' if kind is float else 'an int'}")
    if not v > 0:
        raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be positive")
    return kind(v)
