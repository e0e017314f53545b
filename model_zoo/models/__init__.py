"""One module per architecture, named by GGUF `general.architecture`, each with a frozen
`Config` (HParams subclass: `Config.from_gguf(metadata, arch)`) and `build(cfg, g, w, shape)`:
the forward pass into graph g, returning the logits, each weight read as `w(name, shape)` where
it is used (model_zoo.tensors derives the tensor list from that). Most are a few hooks over the
shared loop in model_zoo.decoder. A new architecture is one file and one line here; an alias
maps another name to the same module and reads its metadata under its own name."""
from __future__ import annotations

import importlib
from types import ModuleType

from hearthlm.core.errors import UnsupportedModelError

ARCHITECTURES = {  # general.architecture -> module
    "bert": "bert",
    "nomic-bert": "nomic_bert",
    "jina-bert-v2": "jina_bert_v2",
    "lfm2": "lfm2",
    "lfm2moe": "lfm2moe",
    "llama": "llama",
    "mistral3": "mistral3",
    "olmo2": "olmo2",
    "smollm3": "smollm3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "gemma4-assistant": "gemma4_assistant",
    "gemma-embedding": "gemma_embedding",
    "gpt-oss": "gpt_oss",
    "granitehybrid": "granitehybrid",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen2vl": "qwen2vl",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "qwen3vl": "qwen3vl",
    "qwen3vlmoe": "qwen3vlmoe",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35moe",
}


def get_architecture(name: str) -> ModuleType:
    mod = ARCHITECTURES.get(name)
    if mod is None:
        raise UnsupportedModelError(
            f"unknown architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(f"{__name__}.{mod}")
