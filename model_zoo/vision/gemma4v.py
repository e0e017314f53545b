"""Gemma 4's projector (llama.cpp tools/mtmd/models/gemma4v.cpp, PROJECTOR_TYPE_GEMMA4V; E2B, E4B and the
larger dense ones): pixels scaled to [-1, 1], a patch embedding without bias, learned x and y position
tables (one row each per patch column and row), then RMS-norm ViT layers: per-head Q/K norms, V RMS-normed
without weight, a 2D RoPE (NeoX on each half of the head: the patch's column on the first half, its row on
the second, base 100), attention unscaled (kq_scale 1), post-attention and post-FFN norms, a gated FFN; every
linear of the file's that has input/output bounds clamped to them (Gemma4ClippableLinear). The pooler averages
n_merge x n_merge patches (3) and multiplies by sqrt(n_embd); the soft tokens are standardized (std_bias,
std_scale) where the file has them, RMS-normed without weight and projected (mm.input_projection).
Images keep their aspect ratio (clip.cpp's dyn_size preprocessing: sides multiples of patch * merge, 70 to
1120 rows, bicubic). The rows attend causally in E2B and E4B (a text model 1536 or 2560 wide, libmtmd's
mtmd_decode_use_non_causal), else both ways, which Gemma 4's text model applies to its sliding layers only."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.errors import InvalidRequestError, ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.blocks import build_norm
from hearthlm.model_zoo.vision.conv import floats, half
from hearthlm.model_zoo.vision.preprocess import preprocess_dynamic, token_limits
from hearthlm.model_zoo.vision.vit import build_tower
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "<|image>", "<image|>"  # mtmd's img_beg / img_end for Gemma 4
CAUSAL_WIDTHS = (1536, 2560)  # E2B's and E4B's text widths: their image rows attend causally (mtmd.cpp)
MIN_TOKENS, MAX_TOKENS = 70, 1120  # clip.cpp's set_limit_image_tokens for Gemma 4
ROPE_BASE = 100.0  # clip.cpp's hparams.rope_theta for gemma4v (not in the file)
WARMUP_SIDE = 16  # rows per side of the graph built at load (clip.cpp's set_warmup_n_tokens(256))
PATCH, POS_X, POS_Y, STD_BIAS = ("v.patch_embd.weight.f16", "v.position_embd.weight.x", "v.position_embd.weight.y",
                                 "v.std_bias.neg")  # derived weights
F32_MAX = float(np.finfo(np.float32).max)  # clip.cpp's default for a bound the file lacks


@dataclass(frozen=True, eq=False)
class Config:
    n_merge: int                # patches per side averaged into one row (pooling_kernel_size; 3)
    min_pixels: int             # dyn_size's bounds on the resized image's area
    max_pixels: int
    n_pos: int                  # rows of each position table: patches per side at most
    clamps: dict = field(default_factory=dict, repr=False)  # "<linear>.weight" -> (in_lo, in_hi, out_lo, out_hi)

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        k = c.scale_factor or 3
        for name in ("v.patch_embd.weight", "v.position_embd.weight", "mm.input_projection.weight"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (gemma4v projector)")
        kernel = half(floats(weights["v.patch_embd.weight"], where))  # ggml_conv_2d multiplies F16 values
        table = floats(weights["v.position_embd.weight"], where)
        if table.ndim != 3 or table.shape[0] != 2 or table.shape[2] != c.n_embd:
            raise ModelLoadError(f"{where}: v.position_embd.weight {table.shape} is not two tables of "
                                 f"{c.n_embd}-wide rows (x, y)")
        derived = {PATCH: kernel, POS_X: table[0], POS_Y: table[1]}
        if "v.std_bias" in weights and "v.std_scale" in weights:
            derived[STD_BIAS] = -floats(weights["v.std_bias"], where)  # x - b as x + (-b): exact
        for name, a in derived.items():
            a = np.ascontiguousarray(a, np.float32)
            weights[name] = QWeight(name, 0, a.shape, a.view(np.uint8))
        lo, hi = token_limits(MIN_TOKENS, MAX_TOKENS, patch_size=c.patch_size, n_merge=k)
        return cls(n_merge=k, min_pixels=lo, max_pixels=hi, n_pos=table.shape[1], clamps=_clamps(weights, where))


def _clamps(weights, where: str) -> dict:
    """Each linear's bounds (<name>.input_min / input_max / output_min / output_max, scalars), F32_MAX
    where one is absent, as clip.cpp's clamp_info_map. A linear with none is not clamped (clip.cpp clamps it
    to +-F32_MAX, which changes only infinities)."""
    out = {}
    for name in [n for n in weights if n.endswith(".weight")]:
        base = name[:-len(".weight")]
        found = [weights.get(f"{base}.{s}") for s in ("input_min", "input_max", "output_min", "output_max")]
        if any(q is not None for q in found):
            vals = [(-1 if i % 2 == 0 else 1) * F32_MAX if q is None else float(floats(q, where).reshape(-1)[0])
                    for i, q in enumerate(found)]
            out[name] = tuple(vals)
    return out


def bidirectional(n_embd_text: int) -> bool:
    """mtmd_decode_use_non_causal for gemma4v: causal for E2B and E4B (by the text model's width)."""
    return n_embd_text not in CAUSAL_WIDTHS


def n_embd_out(c, pc: Config, weights) -> int:
    return int(weights["mm.input_projection.weight"].shape[0])


def preprocess(c, pc: Config, pixels):
    """(H, W, 3) uint8 -> (3, H', W') float32 at its own aspect, sides multiples of patch * merge (bicubic),
    scaled to [-1, 1] (2x - 1, in the graph's float32) and at half precision, as the patch embedding reads them."""
    x = preprocess_dynamic(pixels, patch_size=c.patch_size, n_merge=pc.n_merge, min_pixels=pc.min_pixels,
                           max_pixels=pc.max_pixels, mean=c.mean, std=c.std).slices[0]
    ny, nx = x.shape[1] // c.patch_size, x.shape[2] // c.patch_size
    if max(nx, ny) > pc.n_pos:
        raise InvalidRequestError(f"the image is {nx}x{ny} patches after resizing; the gemma4v tower's position "
                                  f"tables hold {pc.n_pos} a side")
    return half(x * np.float32(2.0) - np.float32(1.0))


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    k = c.patch_size * pc.n_merge
    return (height // k) * (width // k)


def warmup_size(c, pc: Config) -> tuple[int, int]:
    """(height, width) of the graph built once at load: 16 x 16 rows, or as many as the tables hold."""
    side = min(WARMUP_SIDE, pc.n_pos // pc.n_merge) * pc.n_merge * c.patch_size
    return side, side


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Each patch's column and row (row-major; the position tables' rows), each half-head's RoPE position
    (the column for a head's first half, the row for its second; one list for Q's heads, one for K's where
    they differ), and each patch's image (seg)."""
    b, ny, nx = pixels.shape[0], pixels.shape[2] // c.patch_size, pixels.shape[3] // c.patch_size
    y, x = np.divmod(np.arange(ny * nx, dtype=np.int32), nx)
    xy = np.stack([x, y], axis=1)[:, None, :]  # (n, 1, 2)
    out = dict(pos_x=np.tile(x, b), pos_y=np.tile(y, b), seg=np.repeat(np.arange(b, dtype=np.int32), ny * nx))
    for name, h in {"rope_q": c.n_head, "rope_k": c.n_head_kv}.items():
        out[name] = np.tile(np.broadcast_to(xy, (ny * nx, h, 2)).reshape(-1), b).astype(np.int32)
    return out


def _embedder(pc: Config):
    """build_tower's patch embedding: pixels (already 2x - 1) -> patch embeddings (no bias), plus the x and y
    tables' rows."""
    def embed(c, g: Graph, w, *, n_images: int, height: int, width: int) -> tuple[Tensor, Tensor | None]:
        p, e = c.patch_size, c.n_embd
        n = n_images * (height // p) * (width // p)
        pixels = g.input("pixels", (n_images, 3, height, width), F32)
        x = g.mul_mat(w(PATCH, (e, 3 * p * p)), g.patchify(pixels, p, "inp_patches"), "inp")
        x = g.add(x, g.get_rows(w(POS_X, (pc.n_pos, e)), g.input("pos_x", (n,)), "emb_x"), "inp_pos_x")
        x = g.add(x, g.get_rows(w(POS_Y, (pc.n_pos, e)), g.input("pos_y", (n,)), "emb_y"), "pos_embd")
        return x, g.input("seg", (n,)) if n_images > 1 else None
    return embed


def _linear(pc: Config, g: Graph, w, name: str, x: Tensor, shape, il: int = -1, *,
            optional: bool = False) -> Tensor | None:
    """x @ W.T, x clamped to the linear's input bounds and the product to its output bounds where the file has
    them (clip_graph_gemma4v::build_mm); a bias where the file has one. None: an optional linear it lacks."""
    weight = w(f"{name}.weight", shape, optional=optional)
    if weight is None:
        return None
    bounds = pc.clamps.get(f"{name}.weight")
    short = name.rsplit(".", 1)[-1]
    if bounds is not None:
        x = g.clamp(x, bounds[0], bounds[1], f"{short}_in_clamped", il)
    y = g.mul_mat(weight, x, short, il)
    if bounds is not None:
        y = g.clamp(y, bounds[2], bounds[3], f"{short}_clamped", il)
    b = w(f"{name}.bias", (shape[0],), optional=True)
    return y if b is None else g.add(y, b, f"{short}_b", il)


def _rope_2d(g: Graph, t: Tensor, pos: Tensor, name: str, il: int) -> Tensor:
    """(n, H, d): each head's halves as rows of d/2 (n * H * 2 of them), each turned in NeoX pairs by its
    own position (the column on first halves, the row on second ones): ggml_rope_ext on dims [0, d/2) by x
    and, at offset d/2, by y."""
    n, h, d = t.shape
    r = g.rope(g.reshape(t, (n * h * 2, 1, d // 2), f"{name}_halves", il), pos, n_rot=d // 2, base=ROPE_BASE,
               neox=True, name=f"{name}_pos", il=il)
    return g.reshape(r, (n, h, d), f"{name}_rope", il)


def _layers(pc: Config):
    """build_tower's body: the RMS-norm layers lo..hi over x (n, n_embd)."""
    def run(c, g: Graph, w, x: Tensor, *, seg: Tensor | None, layers: range, **_) -> Tensor:
        e, eps, hd, n = c.n_embd, c.eps, c.head_dim, x.shape[0]
        nq, nk = c.n_head * hd, c.n_head_kv * hd
        rq, rk = g.input("rope_q", (n * c.n_head * 2,)), g.input("rope_k", (n * c.n_head_kv * 2,))
        for il in layers:
            P = f"v.blk.{il}"
            L = lambda name, shape, **kw: w(f"{P}.{name}", shape, **kw)  # noqa: E731
            h = build_norm(g, x, L("ln1.weight", (e,)), eps=eps, name="layer_inp_normed", il=il)
            q = g.reshape(_linear(pc, g, w, f"{P}.attn_q", h, (nq, e), il), (n, c.n_head, hd), "Qcur", il)
            k = g.reshape(_linear(pc, g, w, f"{P}.attn_k", h, (nk, e), il), (n, c.n_head_kv, hd), "Kcur", il)
            v = g.reshape(_linear(pc, g, w, f"{P}.attn_v", h, (nk, e), il), (n, c.n_head_kv, hd), "Vcur", il)
            q = _rope_2d(g, build_norm(g, q, L("attn_q_norm.weight", (hd,)), eps=eps, name="Qcur_norm", il=il), rq,
                         "Qcur", il)
            k = _rope_2d(g, build_norm(g, k, L("attn_k_norm.weight", (hd,)), eps=eps, name="Kcur_norm", il=il), rk,
                         "Kcur", il)
            v = g.rms_norm(v, eps, "Vcur_normed", il)
            att = g.attn_full(q, k, v, scale=1.0, seg=seg, name="kqv_out", il=il)
            att = _linear(pc, g, w, f"{P}.attn_out", att, (e, nq), il)
            att = build_norm(g, att, L("attn_post_norm.weight", (e,)), eps=eps, name="attn_post_normed", il=il)
            x = g.add(att, x, "ffn_inp", il)
            h = build_norm(g, x, L("ln2.weight", (e,)), eps=eps, name="ffn_inp_normed", il=il)
            h = build_norm(g, _ffn(c, pc, g, w, P, h, il), L("ffn_post_norm.weight", (e,)), eps=eps,
                           name="ffn_post_normed", il=il)
            x = g.add(x, h, "layer_out", il)
            ls = w.shape_of(f"{P}.out_scale.weight")  # a layer scalar (clip.cpp's ls_out), where the file has one
            if ls is not None:
                x = g.mul(x, L("out_scale.weight", ls, flat=True), "layer_out_scaled", il)
        return x
    return run


def _ffn(c, pc: Config, g: Graph, w, P: str, h: Tensor, il: int) -> Tensor:
    """clip.cpp's build_ffn with hparams.ffn_op: act(gate) * up where the file has ffn_gate, else act(up);
    then down. The act is the file's (clip.use_gelu / use_silu); Gemma 4's converter writes neither, so
    GELU-quick (x * sigmoid(1.702 x)) as llama.cpp runs it."""
    e, f = c.n_embd, c.n_ff
    up = _linear(pc, g, w, f"{P}.ffn_up", h, (f, e), il)
    gate = _linear(pc, g, w, f"{P}.ffn_gate", h, (f, e), il, optional=True)
    a = up if gate is None else gate
    if c.act == "gelu":
        a = g.gelu(a, "ffn_gelu", il)
    elif c.act == "silu":
        a = g.silu(a, "ffn_silu", il)
    else:
        a = g.mul(a, g.sigmoid(g.scale(a, 1.702, "ffn_quick_in", il), "ffn_quick_sig", il), "ffn_gelu_quick", il)
    if gate is not None:
        a = g.mul(a, up, "ffn_gate_par", il)
    return _linear(pc, g, w, f"{P}.ffn_down", a, (e, f), il)


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    """The rows."""
    ny, nx = shape.height // c.patch_size, shape.width // c.patch_size
    x = build_tower(c, g, w, shape, embed=_embedder(pc), body=_layers(pc))
    x = g.scale(g.pool_2d(x, nx=nx, ny=ny, k=pc.n_merge, name="pool"), math.sqrt(c.n_embd), "pooled")
    bias, scale = w(STD_BIAS, (c.n_embd,), optional=True), w("v.std_scale", (c.n_embd,), optional=True)
    if bias is not None and scale is not None:  # (x - std_bias) * std_scale
        x = g.mul(g.add(x, bias, "std_centred"), scale, "std_scaled")
    x = g.rms_norm(x, c.eps, "mm_inp_normed")
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else c.n_embd
    return _linear(pc, g, w, "mm.input_projection", x, (n_text, c.n_embd))
