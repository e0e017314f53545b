"""Gemma 2: embeddings scaled by sqrt(n_embd), NeoX RoPE, norms before and after both
attention and FFN, GeGLU, attention-logit and final-logit soft-capping (cap * tanh(x / cap)),
sliding-window attention on alternate layers (even ones), the LM head tied to the embedding.
Reference: llama.cpp src/models/gemma2.cpp and its gemma2 hparams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    swa_layers: tuple[bool, ...] = ()  # per layer, whether it slides (the file's pattern, else even layers)
    rope_base_swa: float = 0.0     # local layers' RoPE base (rope.freq_base_swa), 0: the global one
    NEOX, NORM_EPS = True, 1e-6

    @classmethod
    def read(cls, r: Reader) -> dict:
        return dict(attn_softcap=r.opt("attn_logit_softcapping", 50.0, float),
                    final_softcap=r.opt("final_logit_softcapping", 30.0, float),
                    swa_layers=r.swa_layers(2),  # llama.cpp's load_swa_pattern(ml, 2): a period or per layer
                    rope_base_swa=r.opt("rope.freq_base_swa", 0.0, float))

    def is_local(self, il: int) -> bool:
        return self.swa_layers[il]

    def window_of(self, il: int) -> int:
        return (self.sliding_window or 4096) if self.is_local(il) else 0  # 4096: llama.cpp's default for Gemma 2

    @property
    def attn_scale(self) -> float:
        return query_pre_attn_scale(self, n_layer_27b=46)


def query_pre_attn_scale(c: HParams, *, n_layer_27b: int) -> float:
    """query_pre_attn_scalar^-1/2: n_embd / n_head for the 27B (known by its layer count), else head_dim,
    as llama.cpp decides it (Gemma 2 and 3)."""
    return 1.0 / math.sqrt(c.n_embd // c.n_head if c.n_layer == n_layer_27b else c.head_dim)


def build(c: Config, g, w, shape):
    local_rope = dataclasses.replace(c.rope, base=c.rope_base_swa) if c.rope_base_swa else c.rope
    return build_decoder(c, g, w, shape, Decoder(
        rope=lambda il: local_rope if c.is_local(il) else c.rope,
        attn_scale=c.attn_scale, attn_softcap=c.attn_softcap, post_norm=True, act="gelu",
        embd_scale=math.sqrt(c.n_embd), tied=True, final_softcap=c.final_softcap))
