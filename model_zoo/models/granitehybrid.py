"""granitehybrid (IBM Granite 4.0-H): Mamba-2 layers and a few attention layers (GQA; RoPE
unless rope.scaling.finetuned is false, as in the released 4.0-H models), a SwiGLU FFN (or
experts plus a shared expert) in every layer, and Granite's multipliers on the embedding, each
residual branch and the logits. The per-layer attention.head_count_kv array marks the Mamba-2
layers with 0. Reference: llama.cpp
src/models/granite-hybrid.cpp and graph-context-mamba.cpp (build_mamba2_layer)."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.blocks import build_conv, build_ffn, build_moe_ffn, build_norm, build_state, moe_weights
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


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
                 use_rope=r.get("rope.scaling.finetuned", True, bool),
                 # the converter writes 0 and 0 for the dense models (4.0-H-Micro)
                 n_expert=r.get("expert_count", 0, positive=False),
                 n_expert_used=r.get("expert_used_count", 0, positive=False),
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

    def uses_rope(self, il: int) -> bool:
        return self.use_rope

    def has_attention(self, il: int) -> bool:
        return not self.head_count_kv_layers or self.head_count_kv_layers[il] > 0

    def state_of(self, il: int) -> dict[str, tuple[int, ...]]:
        p = self.d_inner // self.n_ssm_head
        return {} if self.has_attention(il) else {"state_conv": (self.d_conv - 1, self.conv_dim),
                                                  "state_ssm": (self.n_ssm_head, p, self.d_state)}


def build_mamba2(c: Config, g, w, inp, h, il: int):
    """in_proj to z | xBC | dt; conv + SiLU over xBC; the selective scan; + D x; times SiLU(z);
    the grouped RMSNorm; out_proj."""
    L, n, di, gs, e = w.layer(il), h.shape[0], c.d_inner, c.n_group * c.d_state, c.n_embd
    hd, p = c.n_ssm_head, c.d_inner // c.n_ssm_head
    zxbcdt = g.mul_mat(L("ssm_in.weight", (2 * di + 2 * gs + hd, e)), h, "ssm_in", il)
    xbc = build_conv(g, inp, g.slice(zxbcdt, di, 2 * di + 2 * gs, "xBC", il), L("ssm_conv1d.weight", (c.conv_dim, c.d_conv)),
                     il=il, bias=L("ssm_conv1d.bias", (c.conv_dim,), optional=True), act="silu")  # as llama.cpp
    x = g.reshape(g.slice(xbc, 0, di, "ssm_x", il), (n, hd, p), "ssm_x_3d", il)
    bb = g.reshape(g.slice(xbc, di, di + gs, "ssm_B", il), (n, c.n_group, c.d_state), "ssm_B_3d", il)
    cc = g.reshape(g.slice(xbc, di + gs, di + 2 * gs, "ssm_C", il), (n, c.n_group, c.d_state), "ssm_C_3d", il)
    dt = g.add(g.slice(zxbcdt, 2 * di + 2 * gs, 2 * di + 2 * gs + hd, "ssm_dt", il), L("ssm_dt.bias", (hd,)),
               "ssm_dt_b", il)
    state = build_state(g, inp, "state_ssm", (hd, p, c.d_state), il=il)
    y = g.ssm_scan(state, x, dt, L("ssm_a", (hd, 1), flat=True), bb, cc, inp.seq_off, inp.state_slot, name="ssm_scan",
                   il=il, snap_slot=inp.snap_slot)  # (n, hd, p)
    d = g.reshape(L("ssm_d", (hd, 1), flat=True), (hd, 1), "ssm_d_2d", il)
    y = g.add(y, g.mul(x, d, "ssm_dx", il), "mamba2_y_add_d", il)
    z = g.reshape(g.slice(zxbcdt, 0, di, "ssm_z", il), (n, hd, p), "ssm_z_3d", il)
    y = g.reshape(g.mul(g.silu(z, "ssm_z_silu", il), y, "ssm_gated", il), (n, c.n_group, di // c.n_group),
                  "ssm_grouped", il)
    norm = g.reshape(L("ssm_norm.weight", (c.n_group, di // c.n_group), flat=True), (c.n_group, di // c.n_group), "ssm_norm_2d", il)
    y = build_norm(g, y, norm, eps=c.norm_eps, name="ssm_norm", il=il)
    return g.mul_mat(L("ssm_out.weight", (e, di)), g.reshape(y, (n, di), "ssm_y_2d", il), "mamba_out", il)


def build_ffn_half(c: Config, g, w, h, il: int):
    L, e = w.layer(il), c.n_embd
    if not c.n_expert:
        return build_ffn(g, h, il=il, gate=L("ffn_gate.weight", (c.n_ff, e)), up=L("ffn_up.weight", (c.n_ff, e)),
                         down=L("ffn_down.weight", (e, c.n_ff)), act="silu")
    out = build_moe_ffn(g, h, il=il, **moe_weights(w, il, n_expert=c.n_expert, n_embd=e, n_ff=c.n_ff),
                        n_expert_used=c.n_expert_used)
    if c.n_ff_shexp:
        f = c.n_ff_shexp
        sh = build_ffn(g, h, il=il, gate=L("ffn_gate_shexp.weight", (f, e)), up=L("ffn_up_shexp.weight", (f, e)),
                       down=L("ffn_down_shexp.weight", (e, f)), act="silu")
        out = g.add(out, sh, "ffn_moe_shexp", il)
    return out


def build(c: Config, g, w, shape):
    def mixer(g, w, inp, h, il):
        return None if c.has_attention(il) else build_mamba2(c, g, w, inp, h, il)
    return build_decoder(c, g, w, shape, Decoder(
        mixer=mixer, ffn=lambda g, w, h, il: build_ffn_half(c, g, w, h, il),
        attn_scale=c.attn_scale, residual_scale=c.residual_scale,
        embd_scale=c.embd_scale if c.embd_scale != 1.0 else None, logit_scale=c.logit_scale))
