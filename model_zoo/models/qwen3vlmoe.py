"""qwen3vlmoe (Qwen3-VL MoE, e.g. Qwen3-VL-30B-A3B's text model): qwen3vl's interleaved M-RoPE and
deepstack slices over qwen3moe's layers (every FFN the softmax top-k experts). Reference: llama.cpp
src/models/qwen3vlmoe.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.decoder import Decoder, build_decoder
from hearthlm.model_zoo.models import qwen3moe, qwen3vl


@dataclass(frozen=True)
class Config(qwen3vl.Config, qwen3moe.Config):
    """Both parents' keys: qwen3vl.Config.read hands on to qwen3moe.Config.read (the MRO)."""


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(qk_norm="head", deepstack=c.n_deepstack, ffn=qwen3moe.moe_ffn(c)))
