"""lfm2moe (LFM2-8B-A1B, LFM2.5-8B-A1B): lfm2's conv and attention layers; after the leading
dense layers, each FFN is top-k experts routed by a sigmoid with a per-expert selection bias
(ffn_exp_probs_b), weights renormalized over the chosen ones. Reference: llama.cpp
src/models/lfm2moe.cpp (the graph is lfm2.cpp's)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.blocks import build_ffn, build_moe_ffn, moe_weights
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.models import lfm2

GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


@dataclass(frozen=True)
class Config(lfm2.Config):
    n_dense_lead: int = 0  # leading_dense_block_count: these first layers keep a dense FFN
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    gating: str = "sigmoid"

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_expert, used = r.experts()
        func = r.opt("expert_gating_func", 2)
        if func not in GATING:
            raise ModelLoadError(f"GGUF metadata {r.key('expert_gating_func')!r} = {func}: unknown gating function")
        return {**super().read(r), "n_dense_lead": r.get("leading_dense_block_count", 0, positive=False),
                "n_expert": n_expert, "n_expert_used": used, "n_ff_exp": r.need("expert_feed_forward_length"),
                "gating": GATING[func]}

    @classmethod
    def from_gguf(cls, md, arch: str) -> "Config":
        # LFM2-MoE's attention does not slide (llama.cpp's lfm2moe reads no sliding_window)
        return dataclasses.replace(super().from_gguf(md, arch), sliding_window=0)

    def is_moe(self, il: int) -> bool:
        return il >= self.n_dense_lead


def build(c: Config, g, w, shape):
    def ffn(g, w, h, il):
        L = w.layer(il)
        if not c.is_moe(il):
            return build_ffn(g, h, il=il, gate=L("ffn_gate.weight", (c.n_ff, c.n_embd)),
                             up=L("ffn_up.weight", (c.n_ff, c.n_embd)), down=L("ffn_down.weight", (c.n_embd, c.n_ff)),
                             act="silu")
        return build_moe_ffn(g, h, il=il, **moe_weights(w, il, n_expert=c.n_expert, n_embd=c.n_embd, n_ff=c.n_ff_exp),
                             n_expert_used=c.n_expert_used, gating=c.gating,
                             probs_bias=L("exp_probs_b.bias", (c.n_expert,)))
    return lfm2.build(c, g, w, shape, ffn=ffn)
