"""qwen2 (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): llama's graph with NeoX
RoPE and biases on Q, K and V. Reference: llama.cpp src/models/qwen2.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    NEOX = True


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(biases="qkv"))
