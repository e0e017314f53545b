"""qwen35moe (Qwen3.5 MoE, e.g. 35B-A3B): qwen35's layers with, in place of the dense FFN, top-k
softmax-routed experts plus a shared expert gated per token by sigmoid(x . ffn_gate_inp_shexp).
Reference: llama.cpp src/models/qwen35moe.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_ffn, build_moe_ffn, build_norm, moe_weights
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.models import qwen35
from hearthlm.model_zoo.tensors import Spec
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(qwen35.Config):
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # 0: no shared expert

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_expert, used = r.experts()
        return {**super().read(r), "n_expert": n_expert, "n_expert_used": used,
                "n_ff_exp": r.need("expert_feed_forward_length"),
                "n_ff_shexp": r.opt("expert_shared_feed_forward_length", 0)}


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    e, x = c.n_embd, c.n_ff_exp
    ffn = {"ffn_gate_inp.weight": (c.n_expert, e), "ffn_gate_exps.weight": (c.n_expert, x, e),
           "ffn_up_exps.weight": (c.n_expert, x, e), "ffn_down_exps.weight": (c.n_expert, e, x)}
    if c.n_ff_shexp:
        ffn |= {"ffn_gate_inp_shexp.weight": (e,), "ffn_gate_shexp.weight": (c.n_ff_shexp, e),
                "ffn_up_shexp.weight": (c.n_ff_shexp, e), "ffn_down_shexp.weight": (e, c.n_ff_shexp)}
    return qwen35.tensors(c, n_vocab, ffn)


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    def ffn(x, il):
        b = f"blk.{il}."
        h = build_norm(g, x, w(b + "post_attention_norm.weight"), eps=c.norm_eps, name="ffn_norm", il=il)
        out = build_moe_ffn(g, h, il=il, **moe_weights(w, il), n_expert_used=c.n_expert_used)
        if c.n_ff_shexp:
            sh = build_ffn(g, h, il=il, gate=w(b + "ffn_gate_shexp.weight"), up=w(b + "ffn_up_shexp.weight"),
                           down=w(b + "ffn_down_shexp.weight"), act="silu")
            gate = g.sum_rows(g.mul(h, w(b + "ffn_gate_inp_shexp.weight"), "shexp_gate_prod", il), "shexp_gate", il)
            out = g.add(out, g.mul(sh, g.sigmoid(gate, "shexp_gate_sigmoid", il), "ffn_shexp_gated", il),
                        "ffn_moe_shexp", il)
        return g.add(x, out, "l_out", il)
    qwen35.build_layers(c, g, w, shape, ffn)
