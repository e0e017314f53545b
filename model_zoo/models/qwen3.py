"""qwen3 (Qwen3 dense): llama's layout with NeoX RoPE, no biases, and a per-head RMSNorm on Q
and K before RoPE. Reference: llama.cpp src/models/qwen3.cpp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_ffn_block, build_inp_embd, build_inputs, build_norm,
                                       build_output, build_qk_norm_rope, build_qkv)
from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.tensors import Spec, layer_specs
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(HParams):
    NEOX = True


def attn_specs(c: HParams) -> dict[str, tuple[int, ...]]:
    """Qwen3's attention tensors (shared with qwen3moe)."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    return {"attn_norm.weight": (c.n_embd,), "attn_q.weight": (q, c.n_embd), "attn_k.weight": (kv, c.n_embd),
            "attn_v.weight": (kv, c.n_embd), "attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,),
            "attn_output.weight": (c.n_embd, q), "ffn_norm.weight": (c.n_embd,)}


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    return [Spec("token_embd.weight", (n_vocab, c.n_embd)), Spec("output_norm.weight", (c.n_embd,)),
            Spec("output.weight", (n_vocab, c.n_embd), optional=True),
            *layer_specs(c.n_layer, {**attn_specs(c), "ffn_gate.weight": (c.n_ff, c.n_embd),
                                     "ffn_up.weight": (c.n_ff, c.n_embd), "ffn_down.weight": (c.n_embd, c.n_ff)})]


def build_attn_block(c: HParams, g: Graph, w, inp, x, il: int):
    """attn_norm, Q/K/V, per-head Q/K norms, RoPE, attention, output projection."""
    b = f"blk.{il}."
    h = build_norm(g, x, w(b + "attn_norm.weight"), eps=c.norm_eps, name="attn_norm", il=il)
    q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                        wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"))
    q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il, q_norm=w(b + "attn_q_norm.weight"),
                    k_norm=w(b + "attn_k_norm.weight"), eps=c.norm_eps)
    return build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"), scale=1.0 / math.sqrt(c.head_dim))


def build_layers(c: HParams, g: Graph, w, shape: BatchShape, ffn) -> None:
    """The whole model with `ffn(x, il)` as each layer's FFN half (dense here, experts in qwen3moe)."""
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp)
    for il in range(c.n_layer):
        x = ffn(g.add(x, build_attn_block(c, g, w, inp, x, il), "ffn_inp", il), il)
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    def ffn(x, il):
        b = f"blk.{il}."
        return build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), eps=c.norm_eps,
                               gate=w(b + "ffn_gate.weight"), up=w(b + "ffn_up.weight"),
                               down=w(b + "ffn_down.weight"), act="silu")
    build_layers(c, g, w, shape, ffn)
