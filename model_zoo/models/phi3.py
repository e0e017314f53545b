"""phi3 (Phi-3, Phi-3.5-mini, Phi-4-mini): one fused attn_qkv projection viewed as Q | K | V,
NeoX RoPE with LongRoPE factors (short or long by the context, with its attention factor),
gate and up fused in ffn_up (SwiGLU over its two halves). Sliding window: llama.cpp disables
it for phi3 (its n_swa is ignored), and so does this. Reference: llama.cpp src/models/phi3.cpp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import build_attn, build_ffn, build_qk_norm_rope, build_qkv
from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    NEOX = True


def build(c: Config, g, w, shape):
    e, nq, nkv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim

    def attn(g, w, inp, h, il):  # one attn_qkv projection, viewed as Q | K | V
        L = w.layer(il)
        q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                            wqkv=L("attn_qkv.weight", (nq + 2 * nkv, e)))
        q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il)
        return build_attn(g, inp, q, k, v, il=il, wo=L("attn_output.weight", (e, nq)),
                          scale=1.0 / math.sqrt(c.head_dim))

    def ffn(g, w, h, il):  # ffn_up holds gate (first half) and up: two row views, fused as any gated FFN
        up = lambda r: w.layer(il)("ffn_up.weight", (2 * c.n_ff, e), rows=r)  # noqa: E731
        return build_ffn(g, h, il=il, gate=up((0, c.n_ff)), up=up((c.n_ff, 2 * c.n_ff)),
                         down=w.layer(il)("ffn_down.weight", (e, c.n_ff)), act="silu")
    return build_decoder(c, g, w, shape, Decoder(mixer=attn, ffn=ffn))
