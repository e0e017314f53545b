"""Gemma 4's assistant (gemma-4-*-assistant, general.architecture "gemma4-assistant"): a small draft
model that runs on its target's state. Its input per token is [the target's embedding of the token times
sqrt(n_target), the target's last hidden state (post output-norm)], projected down (nextn.pre_projection);
its layers are Gemma 4's with Q only: each attends over the target's K/V of the target's last sliding or
full layer (llama.cpp's share rule, through the target's own reuse), keeping none of its own. Out come
logits over the shared vocabulary (its tied embeddings) and the next hidden state in the target's width
(nextn.post_projection) that feeds its next draft. The target's embedding rows and hidden state come in as
one input, "inp_xh" (runtime.draft_heads makes it), and each token's "seq_len" is its horizon: the target's
cache holds positions before the drafted one only. Reference: llama.cpp src/models/gemma4-assistant.cpp."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import F32
from hearthlm.model_zoo.blocks import build_ffn, build_inputs, build_kqv, build_norm, build_residual
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.models import gemma4


@dataclass(frozen=True)
class Config(gemma4.Config):
    n_embd_backbone: int = 0  # the target's width (embedding_length_out)
    # per kind (sliding, full): (target layer whose K/V it reads, its K/V heads, head size); bind() sets them
    target_kv: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_layer = r.need("block_count")
        out = gemma4.Config.read(r)
        nb = r.need("embedding_length_out")
        if nb == r.need("embedding_length"):
            raise ModelLoadError(f"GGUF metadata {r.key('embedding_length_out')!r} must carry the target's hidden "
                                 "size (it equals embedding_length)")
        # standalone (no target bound yet): its own layers' shapes stand in for the target's
        hkv = r.opt("attention.head_count_kv", 1)
        out.update(n_embd_backbone=nb, n_kv_layers=n_layer,
                   target_kv=((0, hkv, out["head_dim_swa"]), (0, hkv, r.opt("attention.key_length", 0)
                                                              or r.need("embedding_length") // r.need("attention.head_count"))))
        return out

    def __post_init__(self) -> None:
        HParams.__post_init__(self)  # no layer keeps K/V: gemma4's sharing rule does not apply

    def layer_memory(self):
        return []  # it keeps nothing: it reads its target's cache


def bind(c: Config, target) -> Config:
    """The assistant's config for this target model (a model_zoo Model): the target layers it reads,
    after checking that it fits them (width, vocabulary, head sizes); ModelLoadError naming the misfit."""
    t = target.config
    if target.arch_name != "gemma4":
        raise ModelLoadError(f"a gemma4-assistant drafts for a gemma4 model, not {target.arch_name}")
    if c.n_embd_backbone != t.n_embd:
        raise ModelLoadError(f"the assistant was made for a target of hidden size {c.n_embd_backbone}; "
                             f"this model's is {t.n_embd}")
    kv = []
    for swa, il in ((True, t.n_layer - 2), (False, t.n_layer - 1)):  # llama.cpp: n_layer - 2 sliding, - 1 full
        if il < 0 or t.swa_layers[il] != swa:
            raise ModelLoadError(f"the target's layer {il} is not a {'sliding' if swa else 'full'} layer: "
                                 "the assistant has no cache of that kind to read")
        src, hd = t.kv_source(il), t.head_dim_of(il)
        mine = c.head_dim_swa if swa else c.head_dim
        if mine != hd:
            raise ModelLoadError(f"the assistant's {'sliding' if swa else 'full'} layers have head size {mine}; "
                                 f"the target's {hd}")
        kv.append((src, t.n_head_kv_of(src), hd))
    return dataclasses.replace(c, target_kv=tuple(kv))


def build(c: Config, g, w, shape):
    e, nb, eps, n = c.n_embd, c.n_embd_backbone, c.norm_eps, shape.n_tokens
    inp = build_inputs(g, shape)
    inp.seq_len = g.input("seq_len", (n,))  # each draft's horizon: the target's tokens before it
    xh = g.input("inp_xh", (n, 2 * nb), F32)  # [target embedding * sqrt(nb), target hidden]
    x = g.mul_mat(w("nextn.pre_projection.weight", (e, 2 * nb)), xh, "pre_proj")
    local = dataclasses.replace(c.rope, n_rot=c.n_rot_swa, base=c.swa_rope_base, scaling="none", freq_scale=1.0,
                                factors=())
    for il in range(c.n_layer):
        L, hd, swa = w.layer(il), c.head_dim_of(il), c.swa_layers[il]
        src, hkv, _ = c.target_kv[0 if swa else 1]
        h = build_norm(g, x, L("attn_norm.weight", (e,)), eps=eps, name="attn_norm", il=il)
        q = g.reshape(g.mul_mat(L("attn_q.weight", (c.n_head * hd, e)), h, "Qcur", il), (n, c.n_head, hd), "Qcur_3d", il)
        q = g.rope(build_norm(g, q, L("attn_q_norm.weight", (hd,)), eps=eps, name="Qcur_normed", il=il), inp.pos,
                   name="Qcur_pos", il=il, **(local if swa else c.rope).params())
        slots = shape.n_slots  # the target's caches (runtime.draft_heads runs this over the target's memory)
        att = build_kqv(g, q, g.cache("cache_k", (slots, hkv, hd), src), g.cache("cache_v", (slots, hkv, hd), src),
                        inp, il=il, scale=1.0, window=c.window_of(il))
        att = g.mul_mat(L("attn_output.weight", (e, c.n_head * hd)), att, "attn_out", il)
        x = build_residual(g, x, att, name="attn_out_res", il=il, post_norm=L("post_attention_norm.weight", (e,)),
                           post_name="attn_post_norm", eps=eps)
        f = build_ffn(g, build_norm(g, x, L("ffn_norm.weight", (e,)), eps=eps, name="ffn_norm", il=il), il=il,
                      gate=L("ffn_gate.weight", (c.n_ff, e)), up=L("ffn_up.weight", (c.n_ff, e)),
                      down=L("ffn_down.weight", (e, c.n_ff)), act="gelu")
        x = build_residual(g, x, f, name="ffn_out", il=il, post_norm=L("post_ffw_norm.weight", (e,)),
                           post_name="ffn_post_norm", eps=eps)
        x = g.mul(x, L("layer_output_scale.weight", (1,), flat=True), "out_scaled", il)
    x = build_norm(g, g.get_rows(x, inp.out_rows, "inp_out_ids"), w("output_norm.weight", (e,)), eps=eps,
                   name="result_norm")  # (n_out, e)
    g.outputs.append(g.mul_mat(w("nextn.post_projection.weight", (nb, e)), x, "h_nextn"))  # (n_out, nb)
    return g.mul_mat(w("token_embd.weight", (w.n_vocab, e)), x, "result_output")  # (n_out, n_vocab)

