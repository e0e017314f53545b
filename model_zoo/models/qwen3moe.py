"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head Q/K norms, NeoX
RoPE) and a mixture-of-experts FFN: softmax router, top expert_used_count of expert_count
experts, weights renormalized over the chosen ones. Reference: llama.cpp src/models/qwen3moe.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_moe_ffn, build_norm, build_residual, moe_weights
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.models.qwen3 import attn_specs, build_layers
from hearthlm.model_zoo.tensors import Spec, layer_specs
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph


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
        return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=n_ff_exp)


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    e, f, n = c.n_embd, c.n_ff_exp, c.n_expert
    return [Spec("token_embd.weight", (n_vocab, e)), Spec("output_norm.weight", (e,)),
            Spec("output.weight", (n_vocab, e), optional=True),
            *layer_specs(c.n_layer, {**attn_specs(c), "ffn_gate_inp.weight": (n, e), "ffn_gate_exps.weight": (n, f, e),
                                     "ffn_up_exps.weight": (n, f, e), "ffn_down_exps.weight": (n, e, f)})]


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    def ffn(x, il):
        b = f"blk.{il}."
        h = build_norm(g, x, w(b + "ffn_norm.weight"), eps=c.norm_eps, name="ffn_norm", il=il)
        h = build_moe_ffn(g, h, il=il, **moe_weights(w, il), n_expert_used=c.n_expert_used)
        return build_residual(g, x, h, name="l_out", il=il)
    build_layers(c, g, w, shape, ffn)
