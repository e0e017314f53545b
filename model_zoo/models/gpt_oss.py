"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and a learned sink logit per head,
sliding-window (128) and full layers alternating, NeoX RoPE with YaRN; then a mixture of experts
whose router and experts have biases: the top expert_used_count of the router's raw logits,
weighted by their softmax, each expert a clamped SwiGLU (ggml's swiglu_oai). The FFN's norm is
named post_attention_norm. Reference: llama.cpp src/models/openai-moe.cpp."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_moe_ffn, moe_weights
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    swa_layers: tuple[bool, ...] = ()
    swa_rope_base: float = 0.0  # rope.freq_base_swa (0: the global base)
    NEOX = True

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_expert, used = r.experts()
        return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=r.need("expert_feed_forward_length"),
                    swa_layers=r.swa_layers(2), swa_rope_base=r.opt("rope.freq_base_swa", 0.0, float))

    def is_swa(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_layers[il]

    def window_of(self, il: int) -> int:
        return self.sliding_window if self.is_swa(il) else 0


def build(c: Config, g, w, shape):
    local = dataclasses.replace(c.rope, base=c.swa_rope_base or c.rope.base)
    E, e, f = c.n_expert, c.n_embd, c.n_ff_exp

    def ffn(g, w, h, il):
        L = w.layer(il)
        return build_moe_ffn(g, h, il=il, **moe_weights(w, il, n_expert=E, n_embd=e, n_ff=f),
                             n_expert_used=c.n_expert_used, norm_w=False, gating="softmax_weight", act="swiglu_oai",
                             gate_inp_b=L("ffn_gate_inp.bias", (E,)), up_b=L("ffn_up_exps.bias", (E, f)),
                             gate_b=L("ffn_gate_exps.bias", (E, f)), down_b=L("ffn_down_exps.bias", (E, e)))
    return build_decoder(c, g, w, shape, Decoder(
        rope=lambda il: local if c.is_swa(il) else c.rope,
        biases="qkvo", sinks=True, ffn_norm="post_attention_norm.weight", ffn=ffn))
