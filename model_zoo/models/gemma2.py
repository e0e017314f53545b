"""Gemma 2: embeddings scaled by sqrt(n_embd), NeoX RoPE, norms before and after both
attention and FFN, GeGLU, attention-logit and final-logit soft-capping (cap * tanh(x / cap)),
sliding-window attention on alternate layers (even ones), the LM head tied to the embedding.
Reference: llama.cpp src/models/gemma2.cpp and its gemma2 hparams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_ffn_block, build_inp_embd, build_inputs, build_norm,
                                       build_output, build_qk_norm_rope, build_qkv, build_residual)
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.tensors import Spec, layer_specs
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(HParams):
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    swa_pattern: int = 2           # layer il is local when il % swa_pattern < swa_pattern - 1
    rope_base_swa: float = 0.0     # local layers' RoPE base (rope.freq_base_swa), 0: the global one
    NEOX, NORM_EPS = True, 1e-6

    @classmethod
    def read(cls, r: Reader) -> dict:
        return dict(attn_softcap=r.opt("attn_logit_softcapping", 50.0, float),
                    final_softcap=r.opt("final_logit_softcapping", 30.0, float),
                    swa_pattern=r.opt("attention.sliding_window_pattern", 2),
                    rope_base_swa=r.opt("rope.freq_base_swa", 0.0, float))

    @property
    def window(self) -> int:
        return self.sliding_window or 4096  # llama.cpp's default for Gemma 2

    def is_local(self, il: int) -> bool:
        return il % self.swa_pattern < self.swa_pattern - 1

    @property
    def attn_scale(self) -> float:
        """query_pre_attn_scalar^-1/2: n_embd / n_head for the 27B (46 layers), else head_dim,
        as llama.cpp decides it."""
        return 1.0 / math.sqrt(self.n_embd // self.n_head if self.n_layer == 46 else self.head_dim)


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    q, kv, e = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_embd
    return [Spec("token_embd.weight", (n_vocab, e)), Spec("output_norm.weight", (e,)),
            *layer_specs(c.n_layer, {
                "attn_norm.weight": (e,), "attn_q.weight": (q, e), "attn_k.weight": (kv, e), "attn_v.weight": (kv, e),
                "attn_output.weight": (e, q), "post_attention_norm.weight": (e,), "ffn_norm.weight": (e,),
                "ffn_gate.weight": (c.n_ff, e), "ffn_up.weight": (c.n_ff, e), "ffn_down.weight": (e, c.n_ff),
                "post_ffw_norm.weight": (e,)})]


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp, scale=math.sqrt(c.n_embd))
    local_rope = dataclasses.replace(c.rope, base=c.rope_base_swa) if c.rope_base_swa else c.rope
    norm = dict(eps=c.norm_eps)
    for il in range(c.n_layer):
        b, local = f"blk.{il}.", c.is_local(il)
        h = build_norm(g, x, w(b + "attn_norm.weight"), name="attn_norm", il=il, **norm)
        q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                            wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"))
        q, k = build_qk_norm_rope(g, q, k, inp, local_rope if local else c.rope, il=il)
        h = build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"), scale=c.attn_scale,
                       window=c.window if local else 0, softcap=c.attn_softcap)
        x = build_residual(g, x, h, name="sa_out", il=il, post_norm=w(b + "post_attention_norm.weight"),
                           post_name="attn_post_norm", **norm)
        x = build_ffn_block(g, x, il=il, norm=w(b + "ffn_norm.weight"), gate=w(b + "ffn_gate.weight"),
                            up=w(b + "ffn_up.weight"), down=w(b + "ffn_down.weight"), act="gelu",
                            post_norm=w(b + "post_ffw_norm.weight"), **norm)
    build_output(g, x, inp, norm=w("output_norm.weight"), output=w("token_embd.weight"), eps=c.norm_eps,
                 softcap=c.final_softcap)
