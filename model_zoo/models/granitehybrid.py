"""granitehybrid (IBM Granite 4.0-H): Mamba-2 layers and a few attention layers (GQA; RoPE
unless rope.scaling.finetuned is false, as in the released 4.0-H models), a SwiGLU FFN (or
experts plus a shared expert) in every layer, and Granite's multipliers on the embedding, each
residual branch and the logits. The per-layer attention.head_count_kv array marks the Mamba-2
layers with 0. Reference: llama.cpp
src/models/granite-hybrid.cpp and graph-context-mamba.cpp (build_mamba2_layer)."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.blocks import (build_attn, build_conv, build_ffn, build_inp_embd, build_inputs,
                                       build_moe_ffn, build_norm, build_output, build_qk_norm_rope, build_qkv, build_state,
                                       moe_weights)
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.tensors import Spec
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.errors import ModelLoadError
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config(HParams):
    d_conv: int = 4
    d_inner: int = 0        # ssm.inner_size
    d_state: int = 0        # ssm.state_size
    n_ssm_head: int = 0     # ssm.time_step_rank
    n_group: int = 1        # ssm.group_count
    embd_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    use_rope: bool = True    # rope.scaling.finetuned: Granite's switch for RoPE (absent: on, as llama.cpp)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_shexp: int = 0     # a shared expert's width (experts' own: feed_forward_length, as llama.cpp)

    @classmethod
    def read(cls, r: Reader) -> dict:
        c = dict(d_conv=r.need("ssm.conv_kernel"), d_inner=r.need("ssm.inner_size"), d_state=r.need("ssm.state_size"),
                 n_ssm_head=r.need("ssm.time_step_rank"), n_group=r.opt("ssm.group_count", 1),
                 embd_scale=r.opt("embedding_scale", 1.0, float), residual_scale=r.opt("residual_scale", 1.0, float),
                 logit_scale=r.opt("logit_scale", 1.0, float), attn_scale=r.opt("attention.scale", 0.0, float),
                 use_rope=r.get("rope.scaling.finetuned", True, bool), n_expert=r.opt("expert_count", 0),
                 n_expert_used=r.opt("expert_used_count", 0),
                 n_ff_shexp=r.opt("expert_shared_feed_forward_length", 0))
        if c["d_inner"] % c["n_ssm_head"] or c["d_inner"] % c["n_group"] or c["n_ssm_head"] % c["n_group"]:
            raise ModelLoadError(f"{r.key('ssm.inner_size')} {c['d_inner']} does not split into "
                                 f"{c['n_ssm_head']} heads in {c['n_group']} groups")
        if c["n_expert"] and not 0 < c["n_expert_used"] <= c["n_expert"]:
            raise ModelLoadError(f"{r.key('expert_used_count')} {c['n_expert_used']} does not fit "
                                 f"{c['n_expert']} experts")
        return c

    @property
    def conv_dim(self) -> int:  # the conv runs over x | B | C
        return self.d_inner + 2 * self.n_group * self.d_state

    def has_attention(self, il: int) -> bool:
        return not self.head_count_kv_layers or self.head_count_kv_layers[il] > 0

    def layer_state_dims(self) -> list[dict[str, tuple[int, ...]]]:
        p = self.d_inner // self.n_ssm_head
        rec = {"state_conv": (self.d_conv - 1, self.conv_dim), "state_ssm": (self.n_ssm_head, p, self.d_state)}
        return [{} if self.has_attention(il) else rec for il in range(self.n_layer)]


def tensors(c: Config, n_vocab: int) -> list[Spec]:
    e, q, kv, h = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_ssm_head
    out = [Spec("token_embd.weight", (n_vocab, e)), Spec("output_norm.weight", (e,)),
           Spec("output.weight", (n_vocab, e), optional=True)]
    ffn = ({"ffn_gate_inp.weight": (c.n_expert, e), "ffn_gate_exps.weight": (c.n_expert, c.n_ff, e),
            "ffn_up_exps.weight": (c.n_expert, c.n_ff, e), "ffn_down_exps.weight": (c.n_expert, e, c.n_ff),
            **({"ffn_gate_shexp.weight": (c.n_ff_shexp, e), "ffn_up_shexp.weight": (c.n_ff_shexp, e),
                "ffn_down_shexp.weight": (e, c.n_ff_shexp)} if c.n_ff_shexp else {})}
           if c.n_expert else
           {"ffn_gate.weight": (c.n_ff, e), "ffn_up.weight": (c.n_ff, e), "ffn_down.weight": (e, c.n_ff)})
    for il in range(c.n_layer):
        mixer = ({"attn_q.weight": (q, e), "attn_k.weight": (kv, e), "attn_v.weight": (kv, e),
                  "attn_output.weight": (e, q)} if c.has_attention(il) else
                 {"ssm_in.weight": (2 * c.d_inner + 2 * c.n_group * c.d_state + h, e),
                  "ssm_conv1d.weight": (c.conv_dim, c.d_conv), "ssm_conv1d.bias": (c.conv_dim,),
                  "ssm_dt.bias": (h,), "ssm_a": (h, 1), "ssm_d": (h, 1),
                  "ssm_norm.weight": (c.n_group, c.d_inner // c.n_group), "ssm_out.weight": (e, c.d_inner)})
        per = {"attn_norm.weight": (e,), **mixer, "ffn_norm.weight": (e,), **ffn}
        out += [Spec(f"blk.{il}.{n}", s) for n, s in per.items()]
    return out


def build_mamba2(c: Config, g: Graph, w, inp, h, il: int):
    """in_proj to z | xBC | dt; conv + SiLU over xBC; the selective scan; + D x; times SiLU(z);
    the grouped RMSNorm; out_proj."""
    b, n, di, gs = f"blk.{il}.", h.shape[0], c.d_inner, c.n_group * c.d_state
    hd, p = c.n_ssm_head, c.d_inner // c.n_ssm_head
    zxbcdt = g.mul_mat(w(b + "ssm_in.weight"), h, "ssm_in", il)
    xbc = build_conv(g, inp, g.slice(zxbcdt, di, 2 * di + 2 * gs, "xBC", il), w(b + "ssm_conv1d.weight"), il=il,
                     bias=w(b + "ssm_conv1d.bias"), act="silu")
    x = g.reshape(g.slice(xbc, 0, di, "ssm_x", il), (n, hd, p), "ssm_x_3d", il)
    bb = g.reshape(g.slice(xbc, di, di + gs, "ssm_B", il), (n, c.n_group, c.d_state), "ssm_B_3d", il)
    cc = g.reshape(g.slice(xbc, di + gs, di + 2 * gs, "ssm_C", il), (n, c.n_group, c.d_state), "ssm_C_3d", il)
    dt = g.add(g.slice(zxbcdt, 2 * di + 2 * gs, 2 * di + 2 * gs + hd, "ssm_dt", il), w(b + "ssm_dt.bias"),
               "ssm_dt_b", il)
    state = build_state(g, inp, "state_ssm", (hd, p, c.d_state), il=il)
    y = g.ssm_scan(state, x, dt, w(b + "ssm_a", flat=True), bb, cc, inp.seq_off, inp.state_slot, name="ssm_scan",
                   il=il)  # (n, hd, p)
    d = g.reshape(w(b + "ssm_d", flat=True), (hd, 1), "ssm_d_2d", il)
    y = g.add(y, g.mul(x, d, "ssm_dx", il), "mamba2_y_add_d", il)
    z = g.reshape(g.slice(zxbcdt, 0, di, "ssm_z", il), (n, hd, p), "ssm_z_3d", il)
    y = g.reshape(g.mul(g.silu(z, "ssm_z_silu", il), y, "ssm_gated", il), (n, c.n_group, di // c.n_group),
                  "ssm_grouped", il)
    norm = g.reshape(w(b + "ssm_norm.weight", flat=True), (c.n_group, di // c.n_group), "ssm_norm_2d", il)
    y = build_norm(g, y, norm, eps=c.norm_eps, name="ssm_norm", il=il)
    return g.mul_mat(w(b + "ssm_out.weight"), g.reshape(y, (n, di), "ssm_y_2d", il), "mamba_out", il)


def build_attn_layer(c: Config, g: Graph, w, inp, h, il: int):
    b = f"blk.{il}."
    q, k, v = build_qkv(g, h, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                        wq=w(b + "attn_q.weight"), wk=w(b + "attn_k.weight"), wv=w(b + "attn_v.weight"))
    if c.use_rope:
        q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il)
    return build_attn(g, inp, q, k, v, il=il, wo=w(b + "attn_output.weight"),
                      scale=c.attn_scale or 1.0 / c.head_dim ** 0.5)


def build_ffn_half(c: Config, g: Graph, w, h, il: int):
    b = f"blk.{il}."
    if not c.n_expert:
        return build_ffn(g, h, il=il, gate=w(b + "ffn_gate.weight"), up=w(b + "ffn_up.weight"),
                         down=w(b + "ffn_down.weight"), act="silu")
    out = build_moe_ffn(g, h, il=il, **moe_weights(w, il), n_expert_used=c.n_expert_used)
    if c.n_ff_shexp:
        sh = build_ffn(g, h, il=il, gate=w(b + "ffn_gate_shexp.weight"), up=w(b + "ffn_up_shexp.weight"),
                       down=w(b + "ffn_down_shexp.weight"), act="silu")
        out = g.add(out, sh, "ffn_moe_shexp", il)
    return out


def build(c: Config, g: Graph, w, shape: BatchShape) -> None:
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp, scale=c.embd_scale if c.embd_scale != 1.0 else None)
    for il in range(c.n_layer):
        b = f"blk.{il}."
        h = build_norm(g, x, w(b + "attn_norm.weight"), eps=c.norm_eps, name="attn_norm", il=il)
        h = (build_attn_layer if c.has_attention(il) else build_mamba2)(c, g, w, inp, h, il)
        x = g.add(x, g.scale(h, c.residual_scale, "attn_scaled", il), "ffn_inp", il)
        h = build_norm(g, x, w(b + "ffn_norm.weight"), eps=c.norm_eps, name="ffn_norm", il=il)
        h = build_ffn_half(c, g, w, h, il)
        x = g.add(x, g.scale(h, c.residual_scale, "ffn_scaled", il), "l_out", il)
    logits = build_output(g, x, inp, norm=w("output_norm.weight"),
                          output=w("output.weight", fallback="token_embd.weight"), eps=c.norm_eps)
    if c.logit_scale != 1.0:  # llama.cpp divides the logits by it
        i = g.outputs.index(logits)
        g.outputs[i] = g.scale(logits, 1.0 / c.logit_scale, "result_scaled")
