"""Mistral 3's projector (llama.cpp tools/mtmd/models/pixtral.cpp, PROJECTOR_TYPE_PIXTRAL: Pixtral-12B, Mistral Small
3.1, Ministral 3): a patch embedding, RMS-norm ViT layers (pre-norm v.pre_ln, no learned positions) with a 2D RoPE
(clip.cpp's build_rope_2d, theta 10000: the head's first half turned in adjacent pairs by the patch's row, its second
half by its column at frequencies offset by base^(-2/d)), a gated FFN; Mistral Small 3.1's patch merger where the file
has it (RMS norm mm.input_norm, each 2x2 cell of patches one row as torch's unfold orders it, mm.patch_merger); then a
GELU MLP (mm.1, mm.2) into the text model's width. The tower appends [IMG_BREAK]'s embedding (v.token_embd.img_break)
after each row of image rows but the last: they are image rows, not tokens. mtmd ends an image with [IMG_END] and
no begin marker. Images keep their aspect (clip.cpp's dyn_size: sides multiples of patch * merge, 8 to 1024 rows,
bicubic); rows attend causally."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.blocks import build_norm
from hearthlm.model_zoo.vision.conv import floats, half, half_kernel
from hearthlm.model_zoo.vision.merge import build_merge, merge_inputs
from hearthlm.model_zoo.vision.preprocess import preprocess_dynamic, token_limits
from hearthlm.model_zoo.vision.vit import build_tower, linear
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "", "[IMG_END]"  # mtmd's img_beg / img_end for pixtral
BIDIRECTIONAL = False
MIN_TOKENS, MAX_TOKENS = 8, 1024  # clip.cpp's set_limit_image_tokens for pixtral
ROPE_BASE = 10000.0  # clip.cpp's hparams.rope_theta for pixtral (not in the file)
WARMUP_SIDE = 16  # rows per side of the graph built at load (clip.cpp's set_warmup_n_tokens(256))
BREAK = "v.token_embd.img_break"
MERGER = "mm.patch_merger.weight"
MERGER_ROWS = "mm.patch_merger.weight.rows"  # derived: its columns in merge.build_merge's order


@dataclass(frozen=True)
class Config:
    n_merge: int     # patches per side merged into one row (clip.vision.spatial_merge_size; 1: Pixtral-12B's none)
    merger: bool     # the file has Mistral Small 3.1's patch merger
    min_pixels: int  # dyn_size's bounds on the resized image's area
    max_pixels: int
    breaks: bool     # the file has [IMG_BREAK]'s embedding (clip.cpp requires it; the graph does without)

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        s = int(md.get("clip.vision.spatial_merge_size", 1))
        for name in ("v.patch_embd.weight", "mm.1.weight", "mm.2.weight"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (pixtral projector)")
        merger = MERGER in weights
        if s < 1 or (s > 1 and not merger):  # clip.cpp counts rows per merged cell but merges only with the merger
            raise ModelLoadError(f"{where}: clip.vision.spatial_merge_size {s} needs {MERGER} (pixtral projector)")
        if merger:
            if "mm.input_norm.weight" not in weights:
                raise ModelLoadError(f"{where}: {MERGER} without mm.input_norm.weight (pixtral projector)")
            w = floats(weights[MERGER], where)
            e = c.n_embd
            if w.ndim != 2 or w.shape[1] != e * s * s:
                raise ModelLoadError(f"{where}: {MERGER} {w.shape} does not take {s}x{s} cells of {e}-wide rows")
            # unfold's columns are (channel, dy, dx); build_merge's rows are (dy, dx, channel): the same values moved
            w = np.ascontiguousarray(w.reshape(-1, e, s, s).transpose(0, 2, 3, 1).reshape(w.shape[0], -1))
            weights[MERGER_ROWS] = QWeight(MERGER_ROWS, 0, w.shape, w.view(np.uint8))
        half_kernel(weights, "v.patch_embd.weight", where)
        lo, hi = token_limits(MIN_TOKENS, MAX_TOKENS, patch_size=c.patch_size, n_merge=s)
        return cls(n_merge=s, merger=merger, min_pixels=lo, max_pixels=hi, breaks=BREAK in weights)


def n_embd_out(c, pc: Config, weights) -> int:
    return int(weights["mm.2.weight"].shape[0])


def preprocess(c, pc: Config, pixels):
    """(H, W, 3) uint8 -> (3, H', W') float32 at its own aspect, sides multiples of patch * merge (bicubic), at half
    precision as the patch embedding reads them."""
    return half(preprocess_dynamic(pixels, patch_size=c.patch_size, n_merge=pc.n_merge, min_pixels=pc.min_pixels,
                                   max_pixels=pc.max_pixels, mean=c.mean, std=c.std).slices[0])


def _cells(c, pc: Config, height: int, width: int) -> tuple[int, int]:
    k = c.patch_size * pc.n_merge
    return width // k, height // k


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    """The merged rows plus one [IMG_BREAK] after each row of them but the last (clip_n_output_tokens)."""
    nx, ny = _cells(c, pc, height, width)
    return nx * ny + (ny - 1 if pc.breaks else 0)


def warmup_size(c, pc: Config) -> tuple[int, int]:
    side = WARMUP_SIDE * c.patch_size * pc.n_merge
    return side, side


def _break_inputs(n_images: int, nx: int, ny: int) -> dict[str, np.ndarray]:
    """Each output row's merged row ("break_rows"; 0 at a break) and whether it is one (1.0 in "break_put"; "break_keep"
    the other way round), over the batch."""
    per = nx * ny + ny - 1
    k = np.arange(per)
    put = (k % (nx + 1)) == nx  # every (nx + 1)-th row, the last row of rows having none
    src = np.where(put, 0, k - k // (nx + 1))
    rows = (src[None, :] + nx * ny * np.arange(n_images)[:, None]).reshape(-1).astype(np.int32)
    put = np.tile(put.astype(np.float32), n_images)[:, None]
    return dict(break_rows=rows, break_put=put, break_keep=np.float32(1) - put)


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Each patch's (row, column) for the RoPE and its image (seg), the merger's order and the breaks' rows."""
    p, b = c.patch_size, pixels.shape[0]
    ny, nx = pixels.shape[2] // p, pixels.shape[3] // p
    y, x = np.divmod(np.arange(ny * nx, dtype=np.int32), nx)
    out = dict(rope_pos=np.tile(np.stack([y, x], axis=1), (b, 1)).astype(np.int32),
               seg=np.repeat(np.arange(b, dtype=np.int32), ny * nx))
    if pc.merger:
        out.update(merge_inputs(b, ny, nx, pc.n_merge))
    if pc.breaks:
        out.update(_break_inputs(b, *_cells(c, pc, pixels.shape[2], pixels.shape[3])))
    return out


def _rope(c, g: Graph, pos: Tensor):
    """build_rope_2d as one multi-position RoPE: pairs (2i, 2i+1) of the first half by the row at base^(-4i/d), those
    of the second half by the column at base^(-(4i+2)/d) (ggml's freq_scale base^(-2/d) on the odd frequencies)."""
    d = c.head_dim
    q = d // 4
    freqs = tuple(ROPE_BASE ** (-4.0 * i / d) for i in range(q)) + tuple(ROPE_BASE ** (-(4.0 * i + 2) / d)
                                                                         for i in range(q))
    kw = dict(n_rot=d, base=ROPE_BASE, neox=False, freqs=freqs, comps=(0,) * q + (1,) * q)

    def rope(qc: Tensor, kc: Tensor, il: int) -> tuple[Tensor, Tensor]:
        return g.rope(qc, pos, name="Qcur_pos", il=il, **kw), g.rope(kc, pos, name="Kcur_pos", il=il, **kw)
    return rope


def _layers(c, g: Graph, w, x: Tensor, *, seg: Tensor | None, layers: range, **_) -> Tensor:
    """build_tower's body: build_vit with NORM_TYPE_RMS (pre-norm where the file has it) over x (n, n_embd)."""
    from hearthlm.model_zoo.vision.vit import build_attn_full
    e, f, eps = c.n_embd, c.n_ff, c.eps
    rope = _rope(c, g, g.input("rope_pos", (x.shape[0], 2)))
    pre = w("v.pre_ln.weight", (e,), optional=True) if layers.start == 0 else None
    if pre is not None:
        x = build_norm(g, x, pre, eps=eps, name="pre_ln")
    for il in layers:
        L = lambda name, shape, **kw: w(f"v.blk.{il}.{name}", shape, **kw)  # noqa: E731
        h = build_norm(g, x, L("ln1.weight", (e,)), eps=eps, name="layer_inp_normed", il=il)
        x = g.add(build_attn_full(c, g, L, h, seg=seg, il=il, rope=rope), x, "ffn_inp", il)
        h = build_norm(g, x, L("ln2.weight", (e,)), eps=eps, name="ffn_inp_normed", il=il)
        up = linear(g, L, "ffn_up", h, (f, e), il)
        gate = linear(g, L, "ffn_gate", h, (f, e), il)
        a = g.silu(gate, "ffn_silu", il) if c.act == "silu" else g.gelu(gate, "ffn_gelu", il)
        x = g.add(x, linear(g, L, "ffn_down", g.mul(a, up, "ffn_gate_par", il), (e, f), il), "layer_out", il)
    return x


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    """The rows, [IMG_BREAK]s among them."""
    if c.act not in ("silu", "gelu"):  # the converter writes one of them (hidden_act)
        raise ModelLoadError(f"the pixtral projector's FFN needs clip.use_silu or clip.use_gelu, not {c.act}")
    x = build_tower(c, g, w, shape, body=_layers)
    p, s, e = c.patch_size, pc.n_merge, c.n_embd
    if pc.merger:
        x = build_norm(g, x, w("mm.input_norm.weight", (e,)), eps=c.eps, name="mm_inp_normed")
        x = build_merge(g, x, n_images=shape.n_images, ny=shape.height // p, nx=shape.width // p, s=s)
        x = g.mul_mat(w(MERGER_ROWS, (e, s * s * e)), x, "mm_patch_merger")
    L = lambda name, shape_, **kw: w(name, shape_, **kw)  # noqa: E731
    n_mid = w.shape_of("mm.1.weight")[0]
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else n_mid
    x = linear(g, L, "mm.2", g.gelu(linear(g, L, "mm.1", x, (n_mid, e), -1), "mm_gelu"), (n_text, n_mid), -1)
    if not pc.breaks:
        return x
    nx, ny = _cells(c, pc, shape.height, shape.width)
    n = shape.n_images * (nx * ny + ny - 1)
    rows = g.mul(g.get_rows(x, g.input("break_rows", (n,)), "img_rows"), g.input("break_keep", (n, 1), F32), "img_kept")
    brk = g.mul(g.input("break_put", (n, 1), F32), w(BREAK, (n_text,)), "img_breaks")
    return g.add(rows, brk, "img_out")
