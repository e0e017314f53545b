"""lfm2 (Liquid LFM2 / LFM2.5): a hybrid of gated short-convolution layers and GQA attention
layers (per-head Q/K norms, NeoX RoPE); every layer has the same SwiGLU FFN. The layer pattern
is the per-layer attention.head_count_kv array: 0 marks a conv layer, whose state is its last
l_cache - 1 inputs. Reference: llama.cpp src/models/lfm2.cpp."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_conv, build_ffn_block, build_inp_embd, build_inputs,
                                       build_norm, build_output, build_qk_norm_rope, build_qkv)
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.tensors import Spec
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.errors import ModelLoadError
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(HParams):
    l_cache: int = 3  # the conv's kernel width (shortconv.l_cache)
    NEOX = True

    @classmethod
    def read(cls, r: Reader) -> dict:
        l_cache = r.need("shortconv.l_cache")
        if l_cache < 2:
            raise ModelLoadError(f"GGUF metadata {r.key('shortconv.l_cache')!r} = {l_cache} must be at least 2")
        return dict(l_cache=l_cache)

    def has_attention(self, il: int) -> bool:
        return not self.head_count_kv_layers or self.head_count_kv_layers[il] > 0

    def layer_state_dims(self) -> list[dict[str, tuple[int, ...]]]:
        return [{} if self.has_attention(il) else {"state_conv": (self.l_cache - 1, self.n_embd)}
                for il in range(self.n_layer)]


def dense_ffn(c: HParams) -> dict[str, tuple[int, ...]]:
    return {"ffn_gate.weight": (c.n_ff, c.n_embd), "ffn_up.weight": (c.n_ff, c.n_embd),
            "ffn_down.weight": (c.n_embd, c.n_ff)}


def tensors(c: Config, n_vocab: int, ffn=None) -> list[Spec]:
    """`ffn(il)`: layer il's FFN tensors (lfm2moe's experts), else the dense SwiGLU's."""
    e, q, kv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    out = [Spec("token_embd.weight", (n_vocab, e)), Spec("token_embd_norm.weight", (e,)),
           Spec("output.weight", (n_vocab, e), optional=True)]
    for il in range(c.n_layer):
        b = f"blk.{il}."
        mixer = ({"attn_q.weight": (q, e), "attn_k.weight": (kv, e), "attn_v.weight": (kv, e),
                  "attn_output.weight": (e, q), "attn_q_norm.weight": (c.head_dim,),
                  "attn_k_norm.weight": (c.head_dim,)} if c.has_attention(il) else
                 {"shortconv.conv.weight": (e, c.l_cache), "shortconv.in_proj.weight": (3 * e, e),
                  "shortconv.out_proj.weight": (e, e)})
        per = {"attn_norm.weight": (e,), **mixer, "ffn_norm.weight": (e,), **(ffn(il) if ffn else dense_ffn(c))}
        out += [Spec(b + n, s) for n, s in per.items()]
    return out


def build_shortconv(c: Config, g: Graph, w, inp, h, il: int):
    """in_proj to B, C, x; the conv over B*x; C times that; out_proj."""
    b, e = f"blk.{il}.", c.n_embd
    bcx = g.mul_mat(w(b + "shortconv.in_proj.weight"), h, "conv_in_proj", il)  # (n_tokens, 3 n_embd)
    bx = g.mul(g.slice(bcx, 0, e, "conv_b", il), g.slice(bcx, 2 * e, 3 * e, "conv_x", il), "conv_bx", il)
    y = build_conv(g, inp, bx, w(b + "shortconv.conv.weight"), il=il)
    y = g.mul(g.slice(bcx, e, 2 * e, "conv_c", il), y, "conv_cy", il)
    return g.mul_mat(w(b + "shortconv.out_proj.weight"), y, "conv_out_proj", il)


def build_attn_layer(c: Config, g: Graph, w, inp, h, il: int):
    b = f"blk.{il}."
    q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                        wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"))
    q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il, q_norm=w(b + "attn_q_norm.weight"),
                    k_norm=w(b + "attn_k_norm.weight"), eps=c.norm_eps)
    return build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"), scale=1.0 / math.sqrt(c.head_dim),
                      window=c.sliding_window)  # LFM2.5's attention layers may slide


def build_dense_ffn(c: Config, g: Graph, w, x, il: int):
    b = f"blk.{il}."
    return build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), eps=c.norm_eps, gate=w(b + "ffn_gate.weight"),
                           up=w(b + "ffn_up.weight"), down=w(b + "ffn_down.weight"), act="silu")


def build(c: Config, g: Graph, w, shape: BatchShape, ffn=build_dense_ffn) -> None:
    """`ffn(c, g, w, x, il)`: the FFN half with its residual (lfm2moe's experts in later layers)."""
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp)
    for il in range(c.n_layer):
        h = build_norm(g, x, w(f"blk.{il}.attn_norm.weight"), eps=c.norm_eps, name="attn_norm", il=il)
        h = (build_attn_layer if c.has_attention(il) else build_shortconv)(c, g, w, inp, h, il)
        x = ffn(c, g, w, g.add(x, h, "ffn_inp", il), il)
    build_output(g, x, inp, norm=w("token_embd_norm.weight", fallback="output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)
