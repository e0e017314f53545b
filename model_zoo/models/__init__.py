"""One module per architecture, named by GGUF `general.architecture`. Each has a frozen
`Config.from_gguf(metadata)` and `build(cfg, g, w, shape)` that adds the
forward pass to graph g."""
from __future__ import annotations

import importlib
from types import ModuleType

from hearthlm.runtime.errors import UnsupportedModelError

ARCHITECTURES = {
    "llama": "llama",
    "gemma3": "gemma3",
}


def get_architecture(name: str) -> ModuleType:
    mod = ARCHITECTURES.get(name)
    if mod is None:
        raise UnsupportedModelError(
            f"unknown architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(f"{__name__}.{mod}")
