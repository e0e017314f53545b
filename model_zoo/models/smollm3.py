"""smollm3 (SmolLM3-3B): llama's layers, with no RoPE on every fourth (NoPE: layers 3, 7, ...,
as llama.cpp's n_no_rope_layer_step = 4). Reference: llama.cpp src/models/smollm3.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder

NO_ROPE_STEP = 4


@dataclass(frozen=True)
class Config(HParams):
    def uses_rope(self, il: int) -> bool:
        return (il + 1) % NO_ROPE_STEP != 0


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(biases="qkv"))
