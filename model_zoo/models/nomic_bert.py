"""nomic-bert (nomic-embed-text v1/v1.5): bert's loop with RoPE (NeoX layout) instead of
absolute positions, one fused QKV projection and a SwiGLU FFN without biases.
Reference: llama.cpp src/models/bert.cpp (its nomic-bert branches)."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.encoder import Encoder, EncoderParams, build_encoder


@dataclass(frozen=True)
class Config(EncoderParams):
    NEOX = True


def build(c: Config, g, w, shape):
    return build_encoder(c, g, w, shape, Encoder(positions="rope", fused_qkv=True, glu=True))
