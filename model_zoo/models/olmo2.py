"""olmo2 (OLMo 2, and OLMo 3 under the same name): no norm before attention or FFN, an RMSNorm
on each half's output before its residual add; RMSNorm over all of Q and over all of K (not per
head) before NeoX RoPE. OLMo 3's sliding-window layers (a per-layer sliding_window_pattern, or
every layer but each fourth) keep unscaled RoPE. Reference: llama.cpp src/models/olmo2.cpp."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    swa_layers: tuple[bool, ...] = ()  # per layer: slides (OLMo 3); empty: none does
    NEOX, NORM_EPS = True, 1e-6

    @classmethod
    def read(cls, r: Reader) -> dict:
        # llama.cpp: sliding_window absent or 0, no layer slides
        return {"swa_layers": r.swa_layers(4)} if r.get("attention.sliding_window", 0, positive=False) else {}

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def window_of(self, il: int) -> int:
        return self.sliding_window if self.is_swa(il) else 0


def build(c: Config, g, w, shape):
    # llama.cpp: sliding layers rotate with freq_scale 1 and no YaRN (ext_factor 0, attn_factor 1)
    local = dataclasses.replace(c.rope, scaling="none", freq_scale=1.0, attn_factor=1.0)
    return build_decoder(c, g, w, shape, Decoder(
        rope=lambda il: local if c.is_swa(il) else c.rope,
        qk_norm="all", biases="qkv", pre_norm=False, post_norm=True))
