"""qwen35 (Qwen3.5 dense): a hybrid of Gated DeltaNet layers (linear attention over a recurrent
state: a causal conv over Q|K|V, L2-normed Q and K, the gated delta rule, a gated RMSNorm) and,
every full_attention_interval-th layer, gated attention (Q's projection carries a sigmoid gate
per head; per-head Q/K norms; partial interleaved M-RoPE: text at (p, p, p), an image's rows at
their grid's). Post-attention norm before the SwiGLU FFN.
Reference: llama.cpp src/models/qwen35.cpp and delta-net-base.cpp."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.blocks import build_attn, build_conv, build_norm, build_qk_norm_rope, build_state
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    d_conv: int = 4          # ssm.conv_kernel
    d_inner: int = 0         # ssm.inner_size: value heads * value head dim
    d_state: int = 0         # ssm.state_size: key head dim
    n_v_heads: int = 0       # ssm.time_step_rank
    n_k_heads: int = 0       # ssm.group_count
    attn_interval: int = 4   # full_attention_interval: layer il attends when (il + 1) % it == 0
    recurrent_layers: tuple[int, ...] = ()  # attention.recurrent_layers, where given: 1 per recurrent layer
    n_nextn: int = 0         # nextn_predict_layers: multi-token-prediction blocks after the main stack (unused)
    NEOX, NORM_EPS, MROPE = True, 1e-6, "imrope"  # interleaved M-RoPE: images' rows at their grid positions

    @classmethod
    def from_gguf(cls, md, arch: str) -> "Config":
        """The main stack only: block_count counts the MTP blocks appended after it."""
        c = super().from_gguf(md, arch)
        if c.n_nextn:
            if c.n_nextn >= c.n_layer:
                raise ModelLoadError(f"{arch}.nextn_predict_layers {c.n_nextn} leaves no layers of {c.n_layer}")
            c = dataclasses.replace(c, n_layer=c.n_layer - c.n_nextn)
        return c

    @classmethod
    def read(cls, r: Reader) -> dict:
        c = dict(d_conv=r.need("ssm.conv_kernel"), d_inner=r.need("ssm.inner_size"), d_state=r.need("ssm.state_size"),
                 n_v_heads=r.need("ssm.time_step_rank"), n_k_heads=r.need("ssm.group_count"),
                 attn_interval=r.opt("full_attention_interval", 4),
                 recurrent_layers=r.per_layer("attention.recurrent_layers", r.need("block_count")) or (),
                 n_nextn=r.get("nextn_predict_layers", 0, positive=False))
        if c["d_inner"] % c["n_v_heads"] or c["n_v_heads"] % c["n_k_heads"]:
            raise ModelLoadError(f"{r.key('ssm.inner_size')} {c['d_inner']} must split into "
                                 f"{r.key('ssm.time_step_rank')} {c['n_v_heads']} value heads, a multiple of "
                                 f"{r.key('ssm.group_count')} {c['n_k_heads']} key heads")
        return c

    @property
    def d_v(self) -> int:
        return self.d_inner // self.n_v_heads

    @property
    def conv_dim(self) -> int:  # the conv runs over Q | K | V
        return 2 * self.n_k_heads * self.d_state + self.d_inner

    def has_attention(self, il: int) -> bool:
        return not self.recurrent_layers[il] if self.recurrent_layers else (il + 1) % self.attn_interval == 0

    def state_of(self, il: int) -> dict[str, tuple[int, ...]]:
        return {} if self.has_attention(il) else {"state_conv": (self.d_conv - 1, self.conv_dim),
                                                  "state_ssm": (self.n_v_heads, self.d_v, self.d_state)}


def build_gated_attn(c: Config, g, w, inp, h, il: int):
    """Attention whose output is gated per head by sigmoid(gate), gate from Q's own projection."""
    L, n, d, e = w.layer(il), h.shape[0], c.head_dim, c.n_embd
    nkv = c.n_head_kv * d
    qg = g.reshape(g.mul_mat(L("attn_q.weight", (2 * c.n_head * d, e)), h, "Qcur_full", il), (n, c.n_head, 2 * d), "Qcur_full_3d", il)
    q, gate = g.slice(qg, 0, d, "Qcur", il), g.slice(qg, d, 2 * d, "gate", il)  # per head: q | gate
    k = g.reshape(g.mul_mat(L("attn_k.weight", (nkv, e)), h, "Kcur", il), (n, c.n_head_kv, d), "Kcur_3d", il)
    v = g.reshape(g.mul_mat(L("attn_v.weight", (nkv, e)), h, "Vcur", il), (n, c.n_head_kv, d), "Vcur_3d", il)
    q, k = build_qk_norm_rope(g, q, k, inp, c.rope, il=il, q_norm=L("attn_q_norm.weight", (d,)),
                              k_norm=L("attn_k_norm.weight", (d,)), eps=c.norm_eps)
    att = build_attn(g, inp, q, k, v, il=il, wo=None, scale=1.0 / math.sqrt(d))  # (n, n_head * d)
    gate = g.reshape(g.sigmoid(gate, "gate_sigmoid", il), (n, c.n_head * d), "gate_2d", il)
    return g.mul_mat(L("attn_output.weight", (e, c.n_head * d)), g.mul(att, gate, "attn_gated", il), "attn_out", il)


def build_delta_net(c: Config, g, w, inp, h, il: int):
    """Gated DeltaNet: conv(Q|K|V) + SiLU, L2-normed Q, K, the delta rule with decay
    exp(softplus(alpha + dt) * A) and rate sigmoid(beta), then RMSNorm(out) * SiLU(z)."""
    L, n, e = w.layer(il), h.shape[0], c.n_embd
    kd, hk, hv, dv = c.n_k_heads * c.d_state, c.n_k_heads, c.n_v_heads, c.d_v
    qkv = build_conv(g, inp, g.mul_mat(L("attn_qkv.weight", (c.conv_dim, e)), h, "qkv_mixed", il),
                     L("ssm_conv1d.weight", (c.conv_dim, c.d_conv)),
                     il=il, act="silu")  # (n, conv_dim)
    q = g.l2_norm(g.reshape(g.slice(qkv, 0, kd, "q_conv", il), (n, hk, c.d_state), "q_3d", il), c.norm_eps, "q_l2", il)
    k = g.l2_norm(g.reshape(g.slice(qkv, kd, 2 * kd, "k_conv", il), (n, hk, c.d_state), "k_3d", il), c.norm_eps,
                  "k_l2", il)
    v = g.reshape(g.slice(qkv, 2 * kd, 2 * kd + c.d_inner, "v_conv", il), (n, hv, dv), "v_3d", il)
    beta = g.sigmoid(g.mul_mat(L("ssm_beta.weight", (hv, e)), h, "beta", il), "beta_sigmoid", il)  # (n, hv)
    alpha = g.add(g.mul_mat(L("ssm_alpha.weight", (hv, e)), h, "alpha", il), L("ssm_dt.bias", (hv,)), "alpha_biased", il)
    gate = g.mul(g.softplus(alpha, "a_softplus", il), L("ssm_a", (hv,)), "gate", il)  # log-decay: A = -exp(A_log)
    state = build_state(g, inp, "state_ssm", (hv, dv, c.d_state), il=il)
    o = g.gated_delta_net(state, q, k, v, gate, beta, inp.seq_off, inp.state_slot,
                          scale=1.0 / math.sqrt(c.d_state), name="delta_net", il=il,
                          snap_slot=inp.snap_slot)  # (n, hv, dv)
    z = g.reshape(g.mul_mat(L("attn_gate.weight", (c.d_inner, e)), h, "z", il), (n, hv, dv), "z_3d", il)
    o = g.mul(build_norm(g, o, L("ssm_norm.weight", (dv,)), eps=c.norm_eps, name="delta_norm", il=il),
              g.silu(z, "z_silu", il), "delta_gated", il)
    return g.mul_mat(L("ssm_out.weight", (e, c.d_inner)), g.reshape(o, (n, c.d_inner), "delta_2d", il), "linear_attn_out", il)


def build(c: Config, g, w, shape, ffn=None):
    """`ffn(g, w, h, il)`: the FFN (qwen35moe's experts); its norm is post_attention_norm."""
    def mixer(g, w, inp, h, il):
        return (build_gated_attn if c.has_attention(il) else build_delta_net)(c, g, w, inp, h, il)
    return build_decoder(c, g, w, shape, Decoder(mixer=mixer, ffn=ffn, ffn_norm="post_attention_norm.weight"))
