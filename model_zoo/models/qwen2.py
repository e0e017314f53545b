"""qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): llama's graph with NeoX
RoPE and biases on Q, K and V. Reference: llama.cpp src/models/qwen2.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.models import llama
from hearthlm.model_zoo.tensors import Spec


@dataclass(frozen=True)
class Config(llama.Config):
    NEOX = True


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    """llama's, less the output-projection bias qwen2 has not."""
    return [s for s in llama.tensors(c, n_vocab) if not s.name.endswith("attn_output.bias")]


build = llama.build
