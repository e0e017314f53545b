"""Qwen3-VL's and Qwen3.5's projector (llama.cpp tools/mtmd/models/qwen3vl.cpp, PROJECTOR_TYPE_QWEN3VL,
"qwen3vl_merger"): a ViT whose patch embedding is the two temporal kernels of a Conv3D summed (a
still image is two equal frames), patches taken in 2x2 blocks (each merged row's four together,
clip.cpp's order), learned positions resized to the image's grid (bilinear, corners aligned), 2D
RoPE in attention (ggml_rope_multi, vision mode) over fused Q|K|V; then the merger: the post
LayerNorm, each 2x2 block's patches side by side, an MLP (GELU) into the text model's width; Qwen3-VL's
deepstack layers' outputs merged the same way (their own LayerNorm and MLP) as further columns of
the rows, which its text model (models/qwen3vl.py) adds to its first layers.
Images keep their aspect ratio (clip.cpp's dyn_size preprocessing: sides multiples of
patch * merge, 8 to 4096 rows); their rows attend causally (mtmd_decode_use_non_causal is false),
and an M-RoPE text model places them on their grid (runtime.request.grid_positions)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.blocks import build_layer_norm
from hearthlm.model_zoo.rope import vision_rope
from hearthlm.model_zoo.vision.conv import floats, half
from hearthlm.model_zoo.vision.preprocess import preprocess_dynamic, token_limits
from hearthlm.model_zoo.vision.vit import build_tower, linear
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "<|vision_start|>", "<|vision_end|>"  # mtmd's img_beg / img_end for Qwen-VL
BIDIRECTIONAL = False
MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp's set_limit_image_tokens for Qwen2/2.5/3-VL
PATCH_SUM = "v.patch_embd.weight+1"  # the two temporal kernels summed (a derived weight)


@dataclass(frozen=True, eq=False)
class Config:
    n_merge: int           # patches per side merged into one row (clip.vision.spatial_merge_size; 2)
    min_pixels: int        # dyn_size's bounds on the resized image's area
    max_pixels: int
    pos_table: np.ndarray = field(repr=False)  # (side, side, n_embd) float32: v.position_embd as a grid
    deepstack: tuple[int, ...] = ()  # layers whose output, merged by v.deepstack.{il}.*, joins the rows (Qwen3-VL)

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        k = int(md.get("clip.vision.spatial_merge_size", 2))
        if k != 2:  # qwen3vl.cpp's merge and positions are written for 2x2
            raise ModelLoadError(f"{where}: clip.vision.spatial_merge_size {k}: the qwen3vl_merger projector merges 2x2")
        for name in ("v.patch_embd.weight", "v.patch_embd.weight.1", "v.position_embd.weight"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (qwen3vl_merger projector)")
        w0, w1 = (half(floats(weights[n], where)) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1"))
        if w0.shape != w1.shape:
            raise ModelLoadError(f"{where}: the temporal patch kernels differ in shape: {w0.shape}, {w1.shape}")
        both = np.ascontiguousarray(w0 + w1, np.float32)
        weights[PATCH_SUM] = QWeight(PATCH_SUM, 0, both.shape, both.view(np.uint8))
        table = floats(weights["v.position_embd.weight"], where)
        side = int(round(np.sqrt(table.shape[0])))
        if side * side != table.shape[0] or table.shape[1] != c.n_embd:
            raise ModelLoadError(f"{where}: v.position_embd.weight {table.shape} is not a square grid of "
                                 f"{c.n_embd}-wide rows")
        lo, hi = token_limits(MIN_TOKENS, MAX_TOKENS, patch_size=c.patch_size, n_merge=k)
        deepstack = tuple(il for il in range(c.n_layer) if f"v.deepstack.{il}.fc1.weight" in weights)
        return cls(n_merge=k, min_pixels=lo, max_pixels=hi, pos_table=table.reshape(side, side, c.n_embd),
                   deepstack=deepstack)


def _n_text(weights) -> int:
    t = weights.get("mm.2.weight")
    return int(t.shape[0]) if t is not None else 0


def n_embd_out(c, pc: Config, weights) -> int:
    """The rows' width: the text model's embedding, and one more slice per deepstack layer (its n_embd_inp)."""
    return _n_text(weights) * (1 + len(pc.deepstack))


def preprocess(c, pc: Config, pixels):
    """(H, W, 3) uint8 -> (3, H', W') float32 at its own aspect, sides multiples of patch * merge (bicubic),
    at half precision as the patch embedding reads them (conv.half: ggml_conv_2d's F16 im2col)."""
    return half(preprocess_dynamic(pixels, patch_size=c.patch_size, n_merge=pc.n_merge, min_pixels=pc.min_pixels,
                                   max_pixels=pc.max_pixels, mean=c.mean, std=c.std).slices[0])


def grid(c, pc: Config, height: int, width: int) -> tuple[int, int]:
    """(nx, ny): the image's rows across and down (clip_n_output_tokens_x / _y)."""
    return width // c.patch_size // pc.n_merge, height // c.patch_size // pc.n_merge


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    nx, ny = grid(c, pc, height, width)
    return nx * ny


def merge_order(ny: int, nx: int) -> np.ndarray:
    """The row-major patches' indices in clip.cpp's order: 2x2 blocks row-major, inside each its
    (dy, dx) row-major, so each merged row's four patches lie together."""
    y, x, dy, dx = np.meshgrid(np.arange(0, ny, 2), np.arange(0, nx, 2), [0, 1], [0, 1], indexing="ij")
    return ((y + dy) * nx + x + dx).reshape(-1).astype(np.int32)


def resize_positions(table: np.ndarray, ny: int, nx: int) -> np.ndarray:
    """The (side, side, E) table at (ny, nx), (ny * nx, E) row-major: ggml_interpolate's bilinear with
    corners aligned, in float32 as ggml computes it; the table itself at its own size."""
    side = table.shape[0]
    if (ny, nx) == (side, side):
        return table.reshape(side * side, -1)

    def axis(n_out: int, n_in: int):
        f32 = np.float32
        sf = f32(n_out - 1) / f32(n_in - 1) if n_out > 1 and n_in > 1 else f32(n_out) / f32(n_in)
        at = np.arange(n_out, dtype=f32) / sf
        i0 = np.clip(np.floor(at).astype(np.int64), 0, n_in - 1)
        i1 = np.clip(np.floor(at).astype(np.int64) + 1, 0, n_in - 1)
        return i0, i1, np.clip(at - i0.astype(f32), f32(0), f32(1))[:, None]

    y0, y1, dy = axis(ny, side)
    x0, x1, dx = axis(nx, side)
    a, b, cc, d = table[y0][:, x0], table[y0][:, x1], table[y1][:, x0], table[y1][:, x1]  # (ny, nx, E)
    dy, one = dy[:, None], np.float32(1)
    out = a * (one - dx) * (one - dy) + b * dx * (one - dy) + cc * (one - dx) * dy + d * dx * dy
    return out.reshape(ny * nx, -1).astype(np.float32)


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """The tower's inputs besides the pixels (B, 3, H, W), each patch in clip.cpp's merged order:
    its row-major index (merge_order), its learned position row, its (y, x, y, x) for the 2D RoPE,
    and its image (seg)."""
    b, ny, nx = pixels.shape[0], pixels.shape[2] // c.patch_size, pixels.shape[3] // c.patch_size
    order = merge_order(ny, nx)
    y, x = np.divmod(order, nx)
    n = ny * nx
    return dict(merge_order=(order[None, :] + n * np.arange(b, dtype=np.int32)[:, None]).reshape(-1),
                pos_embd=np.tile(resize_positions(pc.pos_table, ny, nx)[order], (b, 1)),
                patch_yx=np.tile(np.stack([y, x, y, x], axis=1).astype(np.int32), (b, 1)),
                seg=np.repeat(np.arange(b, dtype=np.int32), n))


def _embed(c, g: Graph, w, *, n_images: int, height: int, width: int) -> tuple[Tensor, Tensor | None]:
    """Pixels -> patch embeddings in the merged order, plus bias and resized positions."""
    p, e = c.patch_size, c.n_embd
    n = n_images * (height // p) * (width // p)
    pixels = g.input("pixels", (n_images, 3, height, width), F32)
    x = g.mul_mat(w(PATCH_SUM, (e, 3 * p * p)), g.patchify(pixels, p, "inp_patches"), "inp_embd")
    x = g.get_rows(x, g.input("merge_order", (n,)), "inp_merged")
    x = g.add(x, w("v.patch_embd.bias", (e,)), "patch_bias")
    x = g.add(x, g.input("pos_embd", (n, e), F32), "inp_pos_emb")
    return x, g.input("seg", (n,)) if n_images > 1 else None


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> tuple[Tensor, list[Tensor]]:
    """The rows, and the deepstack features of the tower's layers: columns
    of the rows, after the merger's (llama.cpp concatenates them so)."""
    p = c.patch_size
    n = shape.n_images * (shape.height // p) * (shape.width // p)
    yx = g.input("patch_yx", (n, 4))
    r = vision_rope(c.head_dim)
    n_text = _n_text(w.tensors) if w.tensors is not None else c.n_embd
    columns: list[Tensor] = []

    def rope(q, k, il):
        return g.rope(q, yx, name="Qcur_rope", il=il, **r), g.rope(k, yx, name="Kcur_rope", il=il, **r)

    def deepstack(x, il):  # a layer's output merged 2x2, LayerNorm'd, through its own MLP
        if il in pc.deepstack:
            f = _merged(c, pc, g, x)
            f = build_layer_norm(g, f, w(f"v.deepstack.{il}.norm.weight", (f.shape[1],)),
                                 w(f"v.deepstack.{il}.norm.bias", (f.shape[1],), optional=True), eps=c.eps,
                                 name="deepstack_norm", il=il)
            columns.append(_mlp(g, w, f, f"v.deepstack.{il}.fc1", f"v.deepstack.{il}.fc2", n_text, il))

    x = build_tower(c, g, w, shape, embed=_embed, rope=rope, on_layer=deepstack)
    return _mlp(g, w, _merged(c, pc, g, x), "mm.0", "mm.2", n_text, -1), columns


def _merged(c, pc: Config, g: Graph, x: Tensor) -> Tensor:
    """(n, E) -> (n / 4, 4E): each 2x2 block's patches side by side (they lie together: merge_order)."""
    k2 = pc.n_merge * pc.n_merge
    return g.reshape(x, (x.shape[0] // k2, k2 * c.n_embd), "merged")


def _mlp(g: Graph, w, x: Tensor, fc1: str, fc2: str, n_out: int, il: int) -> Tensor:
    """fc2(GELU(fc1(x))), biases where the file has them (clip.cpp's FFN_GELU: ggml_gelu)."""
    L = lambda name, shape_, **kw: w(name, shape_, **kw)  # noqa: E731
    m = x.shape[1]
    return linear(g, L, fc2, g.gelu(linear(g, L, fc1, x, (m, m), il), f"{fc1}_gelu", il), (n_out, m), il)
