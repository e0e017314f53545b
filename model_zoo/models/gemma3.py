"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm on Q and K, norms before and
after both attention and FFN, GeGLU (tanh GELU), NEOX RoPE, sliding-window attention on
five of every six layers unless the file's pattern says otherwise (local RoPE base
rope.freq_base_swa, 10000 by default, unscaled), full attention on the rest, an optional final
logit soft-cap. Reference: llama.cpp src/models/gemma3.cpp and its gemma3 hparams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder
from hearthlm.model_zoo.models.gemma2 import query_pre_attn_scale

SWA_PATTERN = 6           # layer il is local unless il % 6 == 5
LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Config(HParams):
    swa_layers: tuple[bool, ...] = ()      # per layer, whether it slides (where the file has a window)
    rope_base_swa: float = LOCAL_ROPE_BASE  # the sliding layers' RoPE base
    final_softcap: float = 0.0
    NEOX, NORM_EPS, ROPE_BASE = True, 1e-6, 1e6

    @classmethod
    def read(cls, r: Reader) -> dict:
        return dict(swa_layers=r.swa_layers(SWA_PATTERN),  # llama.cpp's load_swa_pattern(ml, 6)
                    rope_base_swa=r.opt("rope.freq_base_swa", LOCAL_ROPE_BASE, float),
                    final_softcap=r.get("final_logit_softcapping", 0.0, float, positive=False))

    def is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_layers[il]

    def window_of(self, il: int) -> int:
        return self.sliding_window if self.is_local(il) else 0

    @property
    def attn_scale(self) -> float:
        return query_pre_attn_scale(self, n_layer_27b=62)


def build(c: Config, g, w, shape):
    local_rope = dataclasses.replace(c.rope, base=c.rope_base_swa, scaling="none", freq_scale=1.0, factors=())
    return build_decoder(c, g, w, shape, Decoder(
        rope=lambda il: local_rope if c.is_local(il) else c.rope,
        attn_scale=c.attn_scale,
        qk_norm="head", post_norm=True, act="gelu", embd_scale=math.sqrt(c.n_embd), final_softcap=c.final_softcap))
