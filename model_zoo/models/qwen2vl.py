"""qwen2vl (Qwen2-VL's and Qwen2.5-VL's text model): qwen2 with M-RoPE, its sections in runs (t, h, w:
an image's rows at their grid positions; text at (p, p, p)). Reference: llama.cpp src/models/qwen2vl.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.decoder import Decoder, build_decoder
from hearthlm.model_zoo.models import qwen2


@dataclass(frozen=True)
class Config(qwen2.Config):
    MROPE = "mrope"


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(biases="qkv"))
