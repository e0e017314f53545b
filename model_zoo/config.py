"""Reading architecture hyperparameters from GGUF metadata with errors that name the key."""
from __future__ import annotations

from typing import Any, Mapping

from hearthlm.runtime.errors import ModelLoadError


def need(md: Mapping[str, Any], key: str) -> Any:
    """A required metadata value; numeric ones must be positive."""
    if key not in md:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    v = md[key]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
        raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be positive")
    return v
