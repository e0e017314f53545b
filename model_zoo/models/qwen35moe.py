"""qwen35moe (Qwen3.5 MoE, e.g. 35B-A3B): qwen35's layers with, in place of the dense FFN, top-k
softmax-routed experts plus a shared expert gated per token by sigmoid(x . ffn_gate_inp_shexp).
Reference: llama.cpp src/models/qwen35moe.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_ffn, build_moe_ffn, moe_weights
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.models import qwen35


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


def moe_ffn(c: Config, g, w, h, il: int):
    """Layer il's experts, plus the shared expert gated per token (also the MTP block's FFN: qwen35_mtp)."""
    L, e, f = w.layer(il), c.n_embd, c.n_ff_shexp
    out = build_moe_ffn(g, h, il=il, **moe_weights(w, il, n_expert=c.n_expert, n_embd=e, n_ff=c.n_ff_exp),
                        n_expert_used=c.n_expert_used)
    if not f:
        return out
    sh = build_ffn(g, h, il=il, gate=L("ffn_gate_shexp.weight", (f, e)), up=L("ffn_up_shexp.weight", (f, e)),
                   down=L("ffn_down_shexp.weight", (e, f)), act="silu")
    # the converter writes shared_expert_gate as it is, (1, n_embd); llama.cpp's {n_embd} takes that or (n_embd,)
    gi = "ffn_gate_inp_shexp.weight"
    shape = (1, e) if w.shape_of(f"blk.{il}.{gi}") == (1, e) else (e,)
    gate = g.sum_rows(g.mul(h, L(gi, shape, flat=True), "shexp_gate_prod", il), "shexp_gate", il)
    return g.add(out, g.mul(sh, g.sigmoid(gate, "shexp_gate_sigmoid", il), "ffn_shexp_gated", il), "ffn_moe_shexp", il)


def build(c: Config, g, w, shape):
    return qwen35.build(c, g, w, shape, ffn=lambda g, w, h, il: moe_ffn(c, g, w, h, il))
