"""Qwen3.5's multi-token-prediction block (nextn; blk.{n_layer} after the main stack, in the model's own
file; qwen35 and qwen35moe, whose block's FFN is its experts): a gated-attention layer with its own K/V
cache whose input per token is
eh_proj([RMSNorm(token embedding) * enorm, RMSNorm(the target's hidden state of the token before) * hnorm]);
out come logits (nextn.shared_head_head, else the model's head) and its own next hidden state (after
nextn.shared_head_norm, else output_norm), which feeds its next draft. The two normed halves are one
input, "inp_eh", made by runtime.draft_heads (the graph has no concatenation). Not an architecture of
its own: `head(model)` is the model with this block's config and builder, run by the MTP drafter.
Reference: llama.cpp src/models/qwen35.cpp (graph_mtp, load_block_mtp)."""
from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass

from hearthlm.core.errors import InvalidRequestError
from hearthlm.core.graph import F32
from hearthlm.model_zoo.blocks import build_ffn, build_inputs, build_norm
from hearthlm.model_zoo.models import qwen35, qwen35moe


@dataclass(frozen=True)
class Config(qwen35.Config):
    block: int = 0  # the GGUF block index of the MTP layer (the main stack's layer count)


@dataclass(frozen=True)
class MoEConfig(qwen35moe.Config):  # qwen35moe's block: its FFN is the experts and the shared expert
    block: int = 0


class _At:
    """The weights with layer 0 read from block `block` (the graph's layer 0 is the MTP layer: its
    K/V cache and placement are the drafter's one layer)."""

    def __init__(self, w, block: int) -> None:
        self.w, self.block = w, block

    def __call__(self, *a, **kw):
        return self.w(*a, **kw)

    def layer(self, il: int):
        return self.w.layer(self.block + il)

    def shape_of(self, name: str):
        return self.w.shape_of(re.sub(r"^blk\.(\d+)\.", lambda m: f"blk.{self.block + int(m[1])}.", name))


def head(model):
    """The model's MTP block as a model (its weights, vocabulary and tokenizer shared); InvalidRequestError
    where it has none."""
    c = model.config
    if model.arch_name not in ("qwen35", "qwen35moe") or not getattr(c, "n_nextn", 0):
        raise InvalidRequestError(f"speculative='mtp' needs a model with multi-token-prediction (nextn) layers: "
                                  f"this {model.arch_name} model has none")
    kind = MoEConfig if isinstance(c, qwen35moe.Config) else Config
    cfg = kind(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, block=c.n_layer)
    cfg = dataclasses.replace(cfg, n_layer=1, recurrent_layers=(0,), head_count_kv_layers=(), n_nextn=0)
    return dataclasses.replace(model, arch=sys.modules[__name__], config=cfg, _views={})


def embeddings_of(model) -> str:
    """The table the block embeds its tokens with: its own where the file has one."""
    own = f"blk.{model.config.block}.nextn.embed_tokens.weight"
    return own if own in model.weights else "token_embd.weight"


def build(c: Config, g, w, shape):
    e, eps, n = c.n_embd, c.norm_eps, shape.n_tokens
    inp = build_inputs(g, shape, n_pos=c.rope.n_pos)
    W = _At(w, c.block)
    L = W.layer(0)
    x = g.mul_mat(L("nextn.eh_proj.weight", (e, 2 * e)), g.input("inp_eh", (n, 2 * e), F32), "mtp_eh_proj", 0)
    h = build_norm(g, x, L("attn_norm.weight", (e,)), eps=eps, name="mtp_attn_norm", il=0)
    x = g.add(x, qwen35.build_gated_attn(c, g, W, inp, h, 0), "mtp_attn_residual", 0)
    h = build_norm(g, x, L("post_attention_norm.weight", (e,)), eps=eps, name="mtp_attn_post_norm", il=0)
    if isinstance(c, qwen35moe.Config):
        f = qwen35moe.moe_ffn(c, g, W, h, 0)
    else:
        f = build_ffn(g, h, il=0, gate=L("ffn_gate.weight", (c.n_ff, e)), up=L("ffn_up.weight", (c.n_ff, e)),
                      down=L("ffn_down.weight", (e, c.n_ff)), act="silu")
    x = g.add(x, f, "mtp_post_ffn", 0)
    x = g.get_rows(x, inp.out_rows, "inp_out_ids")
    norm = L("nextn.shared_head_norm.weight", (e,), optional=True)
    norm = w("output_norm.weight", (e,)) if norm is None else norm
    x = build_norm(g, x, norm, eps=eps, name="h_nextn")  # (n_out, e)
    g.outputs.append(x)
    out = L("nextn.shared_head_head.weight", (w.n_vocab, e), optional=True)
    out = w("output.weight", (w.n_vocab, e), fallback="token_embd.weight") if out is None else out
    return g.mul_mat(out, x, "result_output")
