"""What each layer keeps per sequence between steps, declared once by the architecture
(model_zoo's config.layer_memory()) and read by the KV cache, the recurrent-state cache and the
attention builder (vLLM's kv_cache_interface, llama.cpp's per-layer llama_memory): full or
sliding-window attention with its own K/V, attention over an earlier layer's K/V (Gemma 4's
shared layers), or a recurrent state of fixed shapes (hybrids)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class LayerMemory:
    n_head_kv: int = 0   # K/V heads this layer writes (0: it writes no K/V of its own)
    head_dim: int = 0    # values per K/V head
    window: int = 0      # a sliding layer's window: a query sees the last `window` positions (0: all)
    kv_from: int = -1    # attention over this earlier layer's K/V, written there (-1: its own or none)
    state: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # recurrent state shapes by cache name

    @property
    def kind(self) -> str:
        """"full", "sliding", "shared", "recurrent" or "none" (a layer that keeps nothing)."""
        if self.state:
            return "recurrent"
        if self.kv_from >= 0:
            return "shared"
        if self.n_head_kv:
            return "sliding" if self.window else "full"
        return "none"

    @property
    def kv_dims(self) -> tuple[int, int]:
        """(n_head_kv, head_dim) of the K/V this layer writes; (0, 0) for none."""
        return (self.n_head_kv, self.head_dim) if self.n_head_kv and self.kv_from < 0 else (0, 0)


def kv_dims(layers: list[LayerMemory]) -> list[tuple[int, int]]:
    return [m.kv_dims for m in layers]


def state_dims(layers: list[LayerMemory]) -> list[dict[str, tuple[int, ...]]]:
    return [dict(m.state) for m in layers]
