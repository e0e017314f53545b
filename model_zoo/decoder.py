"""The shared layer loop of decoder-only transformers: llama's (llama.cpp src/models/llama.cpp),
with hooks for what the families built on it vary. An architecture file is its Config and the
hooks it sets; a layer that does not attend (a hybrid's recurrent mixer) or an FFN that is not
the dense gated one (experts) comes in as a function. Every weight is declared where it is read."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from hearthlm.core.graph import Graph, Tensor
from hearthlm.model_zoo.blocks import (
    Inputs,
    build_attn,
    build_deepstack,
    build_ffn,
    build_inp_embd,
    build_inputs,
    build_norm,
    build_output,
    build_qk_norm_rope,
    build_qkv,
    build_residual,
)
from hearthlm.model_zoo.config import HParams
from hearthlm.model_zoo.rope import Rope
from hearthlm.runtime.batch import BatchShape


@dataclass(frozen=True)
class Decoder:
    # attention
    rope: Callable[[int], Rope | None] | None = None  # layer il's RoPE; unset: c.rope where c.uses_rope(il)
    qk_norm: str = ""         # "head": RMSNorm per head on Q and K (Qwen3, Gemma 3); "all": over all heads (OLMo 2)
    biases: str = ""          # which of the q, k, v, o projections may have a bias ("qkvo": llama's)
    attn_scale: float = 0.0   # 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0
    sinks: bool = False       # a learned logit per head in each softmax's denominator (gpt-oss's attn_sinks)
    q_scale: Callable[[Graph, Inputs, Tensor, int], Tensor] | None = None  # per-token factor on Q (Ministral 3)
    # each layer
    pre_norm: bool = True     # attn_norm / ffn_norm on each half's input (OLMo 2 has none)
    post_norm: bool = False   # post_attention_norm / post_ffw_norm on each half's output (Gemma 2/3, OLMo 2)
    act: str = "silu"         # the dense FFN's gate: "silu" (SwiGLU) or "gelu" (GeGLU)
    residual_scale: float = 1.0  # each half's output times this before its residual add (Granite)
    mixer: Callable | None = None  # (g, w, inp, h, il) -> layer il's mixer output, or None where it attends
    ffn: Callable | None = None    # (g, w, h, il) -> the FFN of the normed input (experts); unset: dense gated
    ffn_norm: str = "ffn_norm.weight"  # its name (Qwen3.5: post_attention_norm.weight)
    # the ends
    embd_scale: float | None = None  # the embeddings times this (Gemma: sqrt(n_embd))
    tied: bool = False        # the LM head is token_embd, output.weight never read (Gemma 2)
    final_softcap: float = 0.0
    logit_scale: float = 1.0  # the logits divided by it (Granite)
    out_norm: tuple[str, ...] = ("output_norm.weight",)  # the final norm's name (and a fallback: LFM2)
    deepstack: int = 0        # the first layers whose outputs take a slice of each image row (Qwen3-VL)
    # an embedder (gemma-embedding): no LM head; (g, w, h) -> each token's normed state projected
    embed_out: Callable | None = None


def build_decoder(c: HParams, g: Graph, w, shape: BatchShape, d: Decoder = Decoder()) -> Tensor:
    """The forward pass; returns the logits."""
    e, eps = c.n_embd, c.norm_eps
    inp = build_inputs(g, shape, causal=c.CAUSAL, n_pos=c.rope.n_pos)
    x = build_inp_embd(g, w("token_embd.weight", (w.n_vocab, e)), inp, scale=d.embd_scale,
                       n_embd_inp=e * (1 + d.deepstack))
    for il in range(c.n_layer):
        L = w.layer(il)
        h = build_norm(g, x, L("attn_norm.weight", (e,)), eps=eps, name="attn_norm", il=il) if d.pre_norm else x
        m = d.mixer(g, w, inp, h, il) if d.mixer else None
        x = _residual(g, x, build_self_attn(c, g, L, inp, h, il, d) if m is None else m, d, il, eps=eps,
                      post=L("post_attention_norm.weight", (e,)) if d.post_norm else None,
                      post_name="attn_post_norm", name="ffn_inp")
        h = build_norm(g, x, L(d.ffn_norm, (e,)), eps=eps, name="ffn_norm", il=il) if d.pre_norm else x
        h = d.ffn(g, w, h, il) if d.ffn else build_ffn(
            g, h, il=il, gate=L("ffn_gate.weight", (c.n_ff, e)), up=L("ffn_up.weight", (c.n_ff, e)),
            down=L("ffn_down.weight", (e, c.n_ff)), act=d.act)
        x = _residual(g, x, h, d, il, eps=eps, post=L("post_ffw_norm.weight", (e,)) if d.post_norm else None,
                      post_name="ffn_post_norm", name="l_out")
        if il < d.deepstack:
            x = build_deepstack(g, x, inp, il=il)
    if d.embed_out is not None:  # the encoder's outputs (model_zoo.encoder): the rows' states, every token's
        h = d.embed_out(g, w, build_norm(g, x, w(d.out_norm[0], (e,)), eps=eps, name="result_norm"))
        if shape.embd:
            g.outputs.append(h)
        return g.get_rows(h, inp.out_rows, "inp_out_ids")
    head = (w("token_embd.weight", (w.n_vocab, e)) if d.tied else
            w("output.weight", (w.n_vocab, e), fallback="token_embd.weight"))
    norm = w(d.out_norm[0], (e,), fallback=d.out_norm[1] if len(d.out_norm) > 1 else None)
    logits = build_output(g, x, inp, norm=norm, output=head, eps=eps,
                          softcap=d.final_softcap)
    return logits if d.logit_scale == 1.0 else g.scale(logits, 1.0 / d.logit_scale, "result_scaled")


def build_self_attn(c: HParams, g: Graph, L, inp: Inputs, h: Tensor, il: int, d: Decoder) -> Tensor:
    """Q/K/V (biases where the file has them), Q/K norms, RoPE, the attention core, the output projection."""
    e, hd = c.n_embd, c.head_dim
    nq, nkv = c.n_head * hd, c.n_head_kv * hd
    bias = lambda p, size: L(f"attn_{p}.bias", (size,), optional=True) if p[0] in d.biases else None  # noqa: E731
    q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=hd,
                        wq=L("attn_q.weight", (nq, e)), wk=L("attn_k.weight", (nkv, e)),
                        wv=L("attn_v.weight", (nkv, e)), bq=bias("q", nq), bk=bias("k", nkv), bv=bias("v", nkv))
    norms = {}
    if d.qk_norm == "head":
        norms = dict(q_norm=L("attn_q_norm.weight", (hd,)), k_norm=L("attn_k_norm.weight", (hd,)), eps=c.norm_eps)
    elif d.qk_norm == "all":  # over the whole projection, before the split into heads
        q = _norm_all(g, q, L("attn_q_norm.weight", (nq,)), c.norm_eps, "Qcur", il)
        k = _norm_all(g, k, L("attn_k_norm.weight", (nkv,)), c.norm_eps, "Kcur", il)
    rope = (d.rope(il) if d.rope else c.rope) if c.uses_rope(il) else None
    q, k = build_qk_norm_rope(g, q, k, inp, rope, il=il, **norms)
    if d.q_scale is not None:
        q = d.q_scale(g, inp, q, il)
    return build_attn(g, inp, q, k, v, il=il, wo=L("attn_output.weight", (e, nq)), bo=bias("output", e),
                      scale=d.attn_scale or 1.0 / math.sqrt(hd), window=c.window_of(il),
                      softcap=d.attn_softcap, sinks=L("attn_sinks.weight", (c.n_head,)) if d.sinks else None)


def _norm_all(g: Graph, t: Tensor, weight: Tensor, eps: float, name: str, il: int) -> Tensor:
    flat = g.reshape(t, (t.shape[0], t.shape[1] * t.shape[2]), f"{name}_2d", il)
    return g.reshape(build_norm(g, flat, weight, eps=eps, name=f"{name}_normed", il=il), t.shape,
                     f"{name}_normed_3d", il)


def _residual(g: Graph, x: Tensor, h: Tensor, d: Decoder, il: int, *, post, post_name: str, name: str,
              eps: float) -> Tensor:
    if d.residual_scale != 1.0:
        h = g.scale(h, d.residual_scale, f"{name}_scaled", il)
    return build_residual(g, x, h, name=name, il=il, post_norm=post, post_name=post_name, eps=eps)
