"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head Q/K norms, NeoX
RoPE) and a mixture-of-experts FFN: softmax router, top expert_used_count of expert_count
experts, weights renormalized over the chosen ones. Reference: llama.cpp src/models/qwen3moe.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_moe_ffn, moe_weights
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    NEOX = True

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_expert, used = r.experts()
        # llama.cpp: expert_feed_forward_length, else feed_forward_length / expert_used_count
        n_ff_exp = r.opt("expert_feed_forward_length", 0) or r.need("feed_forward_length") // used
        return {**super().read(r), "n_expert": n_expert, "n_expert_used": used, "n_ff_exp": n_ff_exp}


def moe_ffn(c: Config):
    """The Decoder's ffn hook: every layer's FFN the experts (qwen3vlmoe's too)."""
    def ffn(g, w, h, il):
        return build_moe_ffn(g, h, il=il, **moe_weights(w, il, n_expert=c.n_expert, n_embd=c.n_embd, n_ff=c.n_ff_exp),
                             n_expert_used=c.n_expert_used)
    return ffn


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(qk_norm="head", ffn=moe_ffn(c)))
