"""mistral3 (Ministral 3, the text model of Mistral Small 3.x): llama's layers (an optional
output-projection bias) with YaRN RoPE whose ramp bounds the file gives, and Llama 4's attention temperature on Q past the original context:
q * (log(floor(pos / n_ctx_orig) + 1) * temperature_scale + 1). Reference: llama.cpp
src/models/mistral3.cpp and llm_graph_input_attn_temp."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    temp_scale: float = 0.0  # attention.temperature_scale (llama_4_scaling_beta); 0: none

    @classmethod
    def from_gguf(cls, md, arch: str) -> "Config":
        c = super().from_gguf(md, arch)
        r = Reader(md, arch)
        # llama.cpp reads the ramp bounds and the log multiplier for mistral3 alone (other files' are ignored)
        rope = dataclasses.replace(c.rope, beta_fast=r.opt("rope.scaling.yarn_beta_fast", c.rope.beta_fast, float),
                                   beta_slow=r.opt("rope.scaling.yarn_beta_slow", c.rope.beta_slow, float),
                                   yarn_log_mul=r.get("rope.scaling.yarn_log_multiplier", 0.0, float, positive=False))
        return dataclasses.replace(c, rope=rope, temp_scale=r.get("attention.temperature_scale", 0.0, float,
                                                                   positive=False))


def build(c: Config, g, w, shape):
    def q_scale(g, inp, q, il):
        t = g.attn_temp(inp.pos, floor=c.rope.n_ctx_orig, beta=c.temp_scale, name="attn_temp", il=il)
        return g.mul(q, t, "Qcur_attn_temp_scaled", il)
    return build_decoder(c, g, w, shape, Decoder(biases="qkvo", q_scale=q_scale if c.temp_scale else None))
