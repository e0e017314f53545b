"""llama (Llama 2/3.x, SmolLM2, Mistral-style GQA models): pre-norm, RoPE (normal mode; Llama
3.1/3.2's rope_freqs factors where the file has them), SwiGLU; optional Q/K/V/output biases.
Reference: llama.cpp src/models/llama.cpp."""
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
    pass


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    return [Spec("token_embd.weight", (n_vocab, c.n_embd)), Spec("output_norm.weight", (c.n_embd,)),
            Spec("output.weight", (n_vocab, c.n_embd), optional=True),
            Spec("rope_freqs.weight", (c.rope.n_rot // 2,), optional=True),
            *layer_specs(c.n_layer, {
                "attn_norm.weight": (c.n_embd,), "attn_q.weight": (q, c.n_embd), "attn_k.weight": (kv, c.n_embd),
                "attn_v.weight": (kv, c.n_embd), "attn_output.weight": (c.n_embd, q),
                "ffn_norm.weight": (c.n_embd,), "ffn_gate.weight": (c.n_ff, c.n_embd),
                "ffn_up.weight": (c.n_ff, c.n_embd), "ffn_down.weight": (c.n_embd, c.n_ff)}),
            *layer_specs(c.n_layer, {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                                     "attn_output.bias": (c.n_embd,)}, optional=True)]


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    """Adds the forward pass to `g`; `w(name)` returns the weight node for a GGUF tensor name."""
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp)
    for il in range(c.n_layer):
        b = f"blk.{il}."
        h = build_norm(g, x, w(b + "attn_norm.weight"), eps=c.norm_eps, name="attn_norm", il=il)
        q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                            wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"),
                            bq=w(b + "attn_q.bias", optional=True), bk=w(b + "attn_k.bias", optional=True),
                            bv=w(b + "attn_v.bias", optional=True))
        q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il)
        h = build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"),
                       bo=w(b + "attn_output.bias", optional=True), scale=1.0 / math.sqrt(c.head_dim))
        x = g.add(x, h, "ffn_inp", il)
        x = build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), eps=c.norm_eps, gate=w(b + "ffn_gate.weight"),
                            up=w(b + "ffn_up.weight"), down=w(b + "ffn_down.weight"), act="silu")
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)
