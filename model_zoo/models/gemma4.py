"""Gemma 4 (text; E2B, E4B, 12B, 31B and 26B-A4B): Gemma 3's layer (embeddings scaled by
sqrt(n_embd), per-head Q/K RMSNorm, norms before and after attention and FFN, GeGLU) with
- sliding and full layers by the file's per-layer pattern, each kind with its own head size, K/V head
  count (the file's per-layer attention.head_count_kv) and RoPE (full layers: rope_freqs'
  proportional factors; sliding ones: rope.freq_base_swa, unscaled);
- V RMS-normed (no weight), attention scale 1 (Q and K are normed);
- the last attention.shared_kv_layers layers keep no K/V: each reads the cache of the last earlier
  layer of its kind (llama.cpp's reuse rule);
- per-layer embeddings (E2B/E4B): a table of per-layer inputs by token, mixed with a projection of
  the embeddings, gated into each layer's output;
- a learned scalar on each layer's output, wider FFNs on some layers, final logit soft-capping;
- 26B-A4B: in each layer, beside the dense FFN (the shared expert, its own post-norm), a mixture of
  experts: a router over the RMS-normed layer input (times sqrt(n_embd)^-1 and a learned scale), softmax,
  top expert_used_count renormalized, fused gate/up experts (GeGLU) scaled per expert, its own pre- and
  post-norms; the two branches summed before the FFN's post-norm;
- image rows that attend both ways (Media.bidirectional: gemma4v's rows unless the model is E2B/E4B; gemma4uv's) do so
  in the sliding layers only, the full ones stay causal (llama.cpp's LLAMA_NON_CAUSAL_TYPE_SWA_ONLY);
  image rows take token 0's per-layer row (the runner's id for them; llama.cpp's TAG_GEMMA4_IMG_PADDING).
12B (converted from Gemma4UnifiedForConditionalGeneration) is 31B's layout; its file's suppress_tokens are the
tokenizer's (never generated). Reference: llama.cpp src/models/gemma4.cpp."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.blocks import (
    build_ffn,
    build_inp_embd,
    build_inputs,
    build_kqv,
    build_moe_ffn,
    build_norm,
    build_output,
    build_residual,
)
from hearthlm.model_zoo.config import HParams, Reader


@dataclass(frozen=True)
class Config(HParams):
    swa_layers: tuple[bool, ...] = ()
    head_dim_swa: int = 0
    n_rot_swa: int = 0
    swa_rope_base: float = 0.0
    n_kv_layers: int = 0           # layers from the first that keep K/V; the rest read an earlier one's
    n_ple: int = 0                 # per-layer input width (0: none)
    ff_layers: tuple[int, ...] = ()
    final_softcap: float = 0.0
    n_expert: int = 0              # 26B-A4B: experts beside the dense FFN (0: none)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    NEOX, NORM_EPS, ROPE_BASE = True, 1e-6, 1e6
    PER_LAYER_KV_HEADS = True  # the converter writes one count for sliding layers, another for full ones

    @classmethod
    def read(cls, r: Reader) -> dict:
        n_layer = r.need("block_count")
        if r.key("attention.sliding_window_pattern") not in r.md:
            raise ModelLoadError(f"GGUF metadata lacks required key {r.key('attention.sliding_window_pattern')!r}")
        head_dim = r.opt("attention.key_length", 0) or r.need("embedding_length") // r.need("attention.head_count")
        hd_swa = r.opt("attention.key_length_swa", head_dim)
        if r.opt("attention.value_length_swa", hd_swa) != hd_swa:
            raise ModelLoadError(f"GGUF metadata {r.key('attention.value_length_swa')!r} differs from "
                                 f"{r.key('attention.key_length_swa')!r}: not supported")
        return dict(swa_layers=r.swa_layers(0), head_dim_swa=hd_swa,
                    n_rot_swa=r.opt("rope.dimension_count_swa", hd_swa),
                    swa_rope_base=r.opt("rope.freq_base_swa", 10000.0, float),
                    n_kv_layers=n_layer - r.get("attention.shared_kv_layers", 0, int, positive=False),
                    n_ple=r.get("embedding_length_per_layer_input", 0, int, positive=False),
                    ff_layers=r.per_layer("feed_forward_length", n_layer) or (),
                    final_softcap=r.get("final_logit_softcapping", 0.0, float, positive=False),
                    **cls._experts(r))

    @staticmethod
    def _experts(r: Reader) -> dict:
        if not r.get("expert_count", 0, int, positive=False):
            return {}
        n_expert, used = r.experts()
        return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=r.need("expert_feed_forward_length"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_rot_swa > self.head_dim_swa or self.n_rot_swa % 2:
            raise ModelLoadError(f"rope.dimension_count_swa {self.n_rot_swa} does not fit head dim {self.head_dim_swa}")
        if self.n_kv_layers < self.n_layer and (self.n_kv_layers < 2 or any(
                self.swa_layers[self.kv_source(il)] != self.swa_layers[il] for il in range(self.n_kv_layers, self.n_layer))):
            raise ModelLoadError(f"attention.shared_kv_layers = {self.n_layer - self.n_kv_layers}: the layers "
                                 "sharing K/V have no earlier layer of their kind to read (llama.cpp's rule)")

    def head_dim_of(self, il: int) -> int:
        return self.head_dim_swa if self.swa_layers[il] else self.head_dim

    def kv_source(self, il: int) -> int:
        """The layer whose K/V layer il attends over (llama.cpp: the last of the KV layers of its kind)."""
        return il if il < self.n_kv_layers else self.n_kv_layers - (2 if self.swa_layers[il] else 1)

    def window_of(self, il: int) -> int:
        return self.sliding_window if self.swa_layers[il] else 0


def build(c: Config, g, w, shape):
    e, eps, n, ple = c.n_embd, c.norm_eps, shape.n_tokens, c.n_ple
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight", (w.n_vocab, e)), inp, scale=math.sqrt(e))
    per_layer = _per_layer_inputs(c, g, w, inp, x) if ple else None  # (n_tokens, n_layer * n_ple)
    local = dataclasses.replace(c.rope, n_rot=c.n_rot_swa, base=c.swa_rope_base, scaling="none", freq_scale=1.0,
                                factors=())
    caches = {}  # layer -> its written K and V caches, for the layers that share them
    causal = dataclasses.replace(inp, seq_len=None) if inp.seq_len is not None else inp  # full layers: no horizons
    for il in range(c.n_layer):
        L, hd, swa = w.layer(il), c.head_dim_of(il), c.swa_layers[il]
        rope = (local if swa else c.rope).params()
        h = build_norm(g, x, L("attn_norm.weight", (e,)), eps=eps, name="attn_norm", il=il)
        q = g.reshape(g.mul_mat(L("attn_q.weight", (c.n_head * hd, e)), h, "Qcur", il), (n, c.n_head, hd), "Qcur_3d", il)
        q = g.rope(build_norm(g, q, L("attn_q_norm.weight", (hd,)), eps=eps, name="Qcur_normed", il=il), inp.pos,
                   name="Qcur_pos", il=il, **rope)
        if il < c.n_kv_layers:
            hkv = c.n_head_kv_of(il)
            k = g.reshape(g.mul_mat(L("attn_k.weight", (hkv * hd, e)), h, "Kcur", il), (n, hkv, hd), "Kcur_3d", il)
            wv = L("attn_v.weight", (hkv * hd, e), optional=True)  # none: V is K's projection
            v = k if wv is None else g.reshape(g.mul_mat(wv, h, "Vcur", il), (n, hkv, hd), "Vcur_3d", il)
            k = g.rope(build_norm(g, k, L("attn_k_norm.weight", (hd,)), eps=eps, name="Kcur_normed", il=il), inp.pos,
                       name="Kcur_pos", il=il, **rope)
            v = g.rms_norm(v, eps, "Vcur_normed", il)
            slots = inp.shape.n_slots
            caches[il] = (g.set_rows(g.cache("cache_k", (slots, hkv, hd), il), k, inp.slots, "k_write", il),
                          g.set_rows(g.cache("cache_v", (slots, hkv, hd), il), v, inp.slots, "v_write", il))
        att = build_kqv(g, q, *caches[c.kv_source(il)], inp if swa else causal, il=il, scale=1.0,
                        window=c.window_of(il))
        att = g.mul_mat(L("attn_output.weight", (e, c.n_head * hd)), att, "attn_out", il)
        x = build_residual(g, x, att, name="ffn_inp", il=il, post_norm=L("post_attention_norm.weight", (e,)),
                           post_name="attn_post_norm", eps=eps)
        f = c.ff_layers[il] if c.ff_layers else c.n_ff
        h = build_ffn(g, build_norm(g, x, L("ffn_norm.weight", (e,)), eps=eps, name="ffn_norm", il=il), il=il,
                      gate=L("ffn_gate.weight", (f, e)), up=L("ffn_up.weight", (f, e)), down=L("ffn_down.weight", (e, f)),
                      act="gelu")
        if c.n_expert:
            h = g.add(build_norm(g, h, L("post_ffw_norm_1.weight", (e,)), eps=eps, name="ffn_mlp", il=il),
                      _experts(c, g, w, x, il), "ffn_moe_combined", il)
        x = build_residual(g, x, h, name="ffn_out", il=il, post_norm=L("post_ffw_norm.weight", (e,)),
                           post_name="ffn_post_norm", eps=eps)
        if per_layer is not None:  # this layer's input gated by its output, projected back, post-normed
            gate = g.gelu(g.mul_mat(L("inp_gate.weight", (ple, e)), x, "ple_gate", il), "ple_gelu", il)
            gate = g.mul(gate, g.slice(per_layer, il * ple, (il + 1) * ple, "ple_inp", il), "ple_gated", il)
            x = build_residual(g, x, g.mul_mat(L("proj.weight", (e, ple)), gate, "ple_proj", il), name="ple_out",
                               il=il, post_norm=L("post_norm.weight", (e,)), post_name="ple_post_norm", eps=eps)
        scale = L("layer_output_scale.weight", (1,), optional=True, flat=True)
        if scale is not None:
            x = g.mul(x, scale, "out_scaled", il)
    head = w("output.weight", (w.n_vocab, e), fallback="token_embd.weight")
    return build_output(g, x, inp, norm=w("output_norm.weight", (e,)), output=head, eps=eps, softcap=c.final_softcap)


def _experts(c: Config, g, w, x, il: int):
    """The experts' branch (llama.cpp: the router reads the layer input, not the pre-normed one)."""
    e, E, f, eps, L = c.n_embd, c.n_expert, c.n_ff_exp, c.norm_eps, w.layer(il)
    r = g.scale(g.rms_norm(x, eps, "ffn_moe_inp_normed", il), 1.0 / math.sqrt(e), "ffn_moe_inp_scaled", il)
    r = g.mul(r, L("ffn_gate_inp.scale", (e,)), "ffn_moe_inp", il)
    logits = g.mul_mat(L("ffn_gate_inp.weight", (E, e)), r, "ffn_moe_logits", il)  # (n_tokens, n_expert)
    # the converter fuses gate and up (ffn_gate_up_exps); llama.cpp also reads them apart
    apart = w.shape_of(f"blk.{il}.ffn_gate_exps.weight") is not None
    fused = L("ffn_gate_up_exps.weight", (E, 2 * f, e), optional=apart)
    experts = dict(gate_up_exps=fused, gate_exps=None, up_exps=None) if fused is not None else dict(
        gate_exps=L("ffn_gate_exps.weight", (E, f, e)), up_exps=L("ffn_up_exps.weight", (E, f, e)))
    h = build_norm(g, x, L("pre_ffw_norm_2.weight", (e,)), eps=eps, name="ffn_norm_2", il=il)
    h = build_moe_ffn(g, h, il=il, gate_inp=None, logits=logits, **experts, down_exps=L("ffn_down_exps.weight", (E, e, f)),
                      down_s=L("ffn_down_exps.scale", (E,), optional=True), n_expert_used=c.n_expert_used, act="gelu")
    return build_norm(g, h, L("post_ffw_norm_2.weight", (e,)), eps=eps, name="ffn_moe", il=il)


def _per_layer_inputs(c: Config, g, w, inp, x):
    """Per token and layer, the table's row (times sqrt(n_ple)) plus the RMS-normed projection of the
    embeddings (divided by sqrt(n_embd)), the sum divided by sqrt(2) (llama.cpp's project_per_layer_inputs)."""
    e, n, width = c.n_embd, x.shape[0], c.n_layer * c.n_ple
    table = w("per_layer_token_embd.weight", (w.n_vocab, width), by_row=True)  # left in the file: rows read per step
    rows = g.scale(g.get_rows(table, inp.tokens, "ple_rows"),
                   math.sqrt(c.n_ple), "ple_rows_scaled")
    proj = g.scale(g.mul_mat(w("per_layer_model_proj.weight", (width, e)), x, "ple_proj_all"), 1.0 / math.sqrt(e),
                   "ple_proj_scaled")
    proj = build_norm(g, g.reshape(proj, (n, c.n_layer, c.n_ple), "ple_proj_3d"),
                      w("per_layer_proj_norm.weight", (c.n_ple,)), eps=c.norm_eps, name="ple_proj_normed")
    return g.scale(g.add(g.reshape(proj, (n, width), "ple_proj_2d"), rows, "ple_sum"), 1.0 / math.sqrt(2.0), "ple_inputs")
