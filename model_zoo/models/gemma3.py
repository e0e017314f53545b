"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm on Q and K, norms before and
after both attention and FFN, GeGLU (tanh GELU), NEOX RoPE, sliding-window attention on
five of every six layers (local RoPE base 10000, unscaled), full attention on every sixth.
Reference: llama.cpp src/models/gemma3.cpp and its gemma3 hparams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_ffn_block, build_inp_embd, build_inputs, build_norm,
                                       build_output, build_qk_norm_rope, build_qkv, build_residual)
from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.tensors import Spec, layer_specs
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph

SWA_PATTERN = 6           # layer il is local unless il % 6 == 5
LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Config(HParams):
    NEOX, NORM_EPS, ROPE_BASE = True, 1e-6, 1e6

    def is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and il % SWA_PATTERN < SWA_PATTERN - 1


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    q, kv, e = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_embd
    return [Spec("token_embd.weight", (n_vocab, e)), Spec("output_norm.weight", (e,)),
            Spec("output.weight", (n_vocab, e), optional=True),
            *layer_specs(c.n_layer, {
                "attn_norm.weight": (e,), "attn_q.weight": (q, e), "attn_k.weight": (kv, e), "attn_v.weight": (kv, e),
                "attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,),
                "attn_output.weight": (e, q), "post_attention_norm.weight": (e,), "ffn_norm.weight": (e,),
                "ffn_gate.weight": (c.n_ff, e), "ffn_up.weight": (c.n_ff, e), "ffn_down.weight": (e, c.n_ff),
                "post_ffw_norm.weight": (e,)})]


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp, scale=math.sqrt(c.n_embd))
    local_rope = dataclasses.replace(c.rope, base=LOCAL_ROPE_BASE, scaling="none", freq_scale=1.0, factors=())
    norm = dict(eps=c.norm_eps)
    for il in range(c.n_layer):
        b, local = f"blk.{il}.", c.is_local(il)
        rope = local_rope if local else c.rope
        h = build_norm(g, x, w(b + "attn_norm.weight"), name="attn_norm", il=il, **norm)
        q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                            wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"))
        q, k = build_qk_norm_rope(g, q, k, inp, rope, il=il, q_norm=w(b + "attn_q_norm.weight"),
                        k_norm=w(b + "attn_k_norm.weight"), **norm)
        h = build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"), scale=1.0 / math.sqrt(c.head_dim),
                       window=c.sliding_window if local else 0)
        x = build_residual(g, x, h, name="sa_out", il=il, post_norm=w(b + "post_attention_norm.weight"),
                           post_name="attn_post_norm", **norm)
        x = build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), gate=w(b + "ffn_gate.weight"),
                            up=w(b + "ffn_up.weight"), down=w(b + "ffn_down.weight"), act="gelu",
                            post_norm=w(b + "post_ffw_norm.weight"), **norm)
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)
