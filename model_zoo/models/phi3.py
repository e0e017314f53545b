"""phi3 (Phi-3, Phi-3.5-mini, Phi-4-mini): one fused attn_qkv projection viewed as Q | K | V,
NeoX RoPE with LongRoPE factors (short or long by the context, with its attention factor),
gate and up fused in ffn_up (SwiGLU over its two halves). Sliding window: llama.cpp disables
it for phi3 (its n_swa is ignored), and so does this. Reference: llama.cpp src/models/phi3.cpp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_ffn_block, build_inp_embd, build_inputs, build_norm,
                                       build_output, build_qk_norm_rope, build_qkv)
from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.rope import LONG, SHORT
from hearthlm.model_zoo.tensors import Spec, layer_specs
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(HParams):
    NEOX = True


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    q, kv, e = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_embd
    return [Spec("token_embd.weight", (n_vocab, e)), Spec("output_norm.weight", (e,)),
            Spec("output.weight", (n_vocab, e), optional=True),
            Spec(LONG, (c.rope.n_rot // 2,), optional=True), Spec(SHORT, (c.rope.n_rot // 2,), optional=True),
            *layer_specs(c.n_layer, {
                "attn_norm.weight": (e,), "attn_qkv.weight": (q + 2 * kv, e), "attn_output.weight": (e, q),
                "ffn_norm.weight": (e,), "ffn_up.weight": (2 * c.n_ff, e), "ffn_down.weight": (e, c.n_ff)})]


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp)
    for il in range(c.n_layer):
        b = f"blk.{il}."
        h = build_norm(g, x, w(b + "attn_norm.weight"), eps=c.norm_eps, name="attn_norm", il=il)
        q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                            wqkv=w(b + "attn_qkv.weight"))
        q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il)
        h = build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"), scale=1.0 / math.sqrt(c.head_dim))
        x = g.add(x, h, "ffn_inp", il)
        # ffn_up holds gate (first half) and up: two row views, so ffn_glu fuses them as usual
        x = build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), eps=c.norm_eps,
                            gate=w(b + "ffn_up.weight", rows=(0, c.n_ff)),
                            up=w(b + "ffn_up.weight", rows=(c.n_ff, 2 * c.n_ff)), down=w(b + "ffn_down.weight"),
                            act="silu")
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)
