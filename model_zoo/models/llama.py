"""llama (Llama 2/3.x, SmolLM2, Mistral-style GQA models): pre-norm, RoPE (normal mode; Llama
3.1/3.2's rope_freqs factors where the file has them), SwiGLU; optional Q/K/V/output biases.
Reference: llama.cpp src/models/llama.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    pass


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(biases="qkvo"))
