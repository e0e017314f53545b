"""qwen3 (Qwen3 dense): llama's layout with NeoX RoPE, no biases, and a per-head RMSNorm on Q
and K before RoPE. Reference: llama.cpp src/models/qwen3.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    NEOX = True


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(qk_norm="head"))
