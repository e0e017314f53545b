"""lfm2moe (LFM2-8B-A1B, LFM2.5-8B-A1B): lfm2's conv and attention layers; after the leading
dense layers, each FFN is top-k experts routed by a sigmoid with a per-expert selection bias
(ffn_exp_probs_b), weights renormalized over the chosen ones. Reference: llama.cpp
src/models/lfm2moe.cpp (the graph is lfm2.cpp's)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_moe_ffn, build_norm, moe_weights
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.models import lfm2
from hearthlm.model_zoo.tensors import Spec
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.errors import ModelLoadError
from hearthlm.runtime.graph import Graph

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


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    e, x, n = c.n_embd, c.n_ff_exp, c.n_expert
    moe = {"ffn_gate_inp.weight": (n, e), "ffn_gate_exps.weight": (n, x, e), "ffn_up_exps.weight": (n, x, e),
           "ffn_down_exps.weight": (n, e, x), "exp_probs_b.bias": (n,)}
    return lfm2.tensors(c, n_vocab, lambda il: moe if c.is_moe(il) else lfm2.dense_ffn(c))


def build_ffn(c: Config, g: Graph, w, x, il: int):
    if not c.is_moe(il):
        return lfm2.build_dense_ffn(c, g, w, x, il)
    b = f"blk.{il}."
    h = build_norm(g, x, w(b + "ffn_norm.weight"), eps=c.norm_eps, name="ffn_norm", il=il)
    h = build_moe_ffn(g, h, il=il, **moe_weights(w, il), n_expert_used=c.n_expert_used, gating=c.gating,
                      probs_bias=w(b + "exp_probs_b.bias"))
    return g.add(x, h, "l_out", il)


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    lfm2.build(c, g, w, shape, ffn=build_ffn)
