"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm on Q and K, norms before and
after both attention and FFN, GeGLU (tanh GELU), NEOX RoPE, sliding-window attention on
five of every six layers (local RoPE base 10000, unscaled), full attention on every sixth.
Reference: llama.cpp src/models/gemma3.cpp and its gemma3 hparams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder

SWA_PATTERN = 6           # layer il is local unless il % 6 == 5
LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Config(HParams):
    NEOX, NORM_EPS, ROPE_BASE = True, 1e-6, 1e6

    def is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and il % SWA_PATTERN < SWA_PATTERN - 1


def build(c: Config, g, w, shape):
    local_rope = dataclasses.replace(c.rope, base=LOCAL_ROPE_BASE, scaling="none", freq_scale=1.0, factors=())
    return build_decoder(c, g, w, shape, Decoder(
        rope=lambda il: local_rope if c.is_local(il) else c.rope,
        window=lambda il: c.sliding_window if c.is_local(il) else 0,
        qk_norm="head", post_norm=True, act="gelu", embd_scale=math.sqrt(c.n_embd)))
