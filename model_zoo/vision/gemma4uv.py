"""Gemma 4 12B's projector (llama.cpp tools/mtmd/models/gemma4uv.cpp, PROJECTOR_TYPE_GEMMA4UV, "unified"): no
tower (the mmproj has no layers). A patch is patch_size * pooling pixels a side (clip.cpp: patch_size *= n_merge,
then n_merge = 1; 12B: 16 x 3 = 48), its raw values (x / 255 with the file's mean 0 and std 1) LayerNorm'd
(v.patch_norm.1), projected with a bias (v.patch_embd), LayerNorm'd (.2), given its column's row of the x table and
its row's of the y table, LayerNorm'd (.3: the checkpoint's pos_norm); the LayerNorms are PyTorch's defaults
(eps 1e-5, not the file's). Then RMS-normed without weight (the file's eps) and projected into the text model
(mm.input_projection). The patches are F32 (the graph's im2col, not conv_2d's F16): no half precision.
Images keep their aspect (clip.cpp's dyn_size: sides multiples of the patch, 70 to 1120 rows, bicubic, as
gemma4v's); libmtmd decodes the rows both ways whatever the text model's width (mtmd_decode_use_non_causal),
which Gemma 4's text model applies to its sliding layers only. The file's audio half (gemma4ua) is not read."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hearthlm.core.errors import InvalidRequestError, ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.blocks import build_layer_norm
from hearthlm.model_zoo.vision.conv import floats
from hearthlm.model_zoo.vision.preprocess import preprocess_dynamic, token_limits
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "<|image>", "<image|>"  # mtmd's img_beg / img_end, as gemma4v's
BIDIRECTIONAL = True
MIN_TOKENS, MAX_TOKENS = 70, 1120  # clip.cpp's set_limit_image_tokens for Gemma 4
LN_EPS = 1e-5  # gemma4uv.cpp: PyTorch's LayerNorm default, not the file's epsilon
WARMUP_SIDE = 16  # rows per side of the graph built at load (clip.cpp's set_warmup_n_tokens(256))
POS_X, POS_Y = "v.position_embd.weight.x", "v.position_embd.weight.y"  # derived weights: the two tables
NEEDED = ("v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "mm.input_projection.weight",
          *(f"v.patch_norm.{i}.{s}" for i in (1, 2, 3) for s in ("weight", "bias")))


@dataclass(frozen=True)
class Config:
    patch: int       # pixels a side of a patch, one row each (patch_size * pooling_kernel_size)
    min_pixels: int  # dyn_size's bounds on the resized image's area
    max_pixels: int
    n_pos: int       # rows of each position table: patches per side at most

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        patch = c.patch_size * (c.scale_factor or 3)  # clip.cpp's default pooling of 3 where the file has none
        for name in NEEDED:
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (gemma4uv projector)")
        table = floats(weights["v.position_embd.weight"], where)
        if table.ndim != 3 or table.shape[0] != 2 or table.shape[2] != c.n_embd:
            raise ModelLoadError(f"{where}: v.position_embd.weight {table.shape} is not two tables of "
                                 f"{c.n_embd}-wide rows (x, y)")
        for name, a in ((POS_X, table[0]), (POS_Y, table[1])):
            a = np.ascontiguousarray(a, np.float32)
            weights[name] = QWeight(name, 0, a.shape, a.view(np.uint8))
        lo, hi = token_limits(MIN_TOKENS, MAX_TOKENS, patch_size=patch, n_merge=1)
        return cls(patch=patch, min_pixels=lo, max_pixels=hi, n_pos=table.shape[1])


def n_embd_out(c, pc: Config, weights) -> int:
    return int(weights["mm.input_projection.weight"].shape[0])


def preprocess(c, pc: Config, pixels):
    """(H, W, 3) uint8 -> (3, H', W') float32 at its own aspect, sides multiples of the patch (bicubic)."""
    x = preprocess_dynamic(pixels, patch_size=pc.patch, n_merge=1, min_pixels=pc.min_pixels,
                           max_pixels=pc.max_pixels, mean=c.mean, std=c.std).slices[0]
    ny, nx = x.shape[1] // pc.patch, x.shape[2] // pc.patch
    if max(nx, ny) > pc.n_pos:
        raise InvalidRequestError(f"the image is {nx}x{ny} patches after resizing; the gemma4uv projector's "
                                  f"position tables hold {pc.n_pos} a side")
    return x


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    return (height // pc.patch) * (width // pc.patch)


def warmup_size(c, pc: Config) -> tuple[int, int]:
    """(height, width) of the graph built once at load: 16 x 16 rows, or as many as the tables hold."""
    side = min(WARMUP_SIDE, pc.n_pos) * pc.patch
    return side, side


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Each patch's column and row (row-major, per image): the position tables' rows."""
    b, ny, nx = pixels.shape[0], pixels.shape[2] // pc.patch, pixels.shape[3] // pc.patch
    y, x = np.divmod(np.arange(ny * nx, dtype=np.int32), nx)
    return dict(pos_x=np.tile(x, b), pos_y=np.tile(y, b))


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    """The rows: (n_images * patches, the text model's width)."""
    p, e = pc.patch, c.n_embd
    n = shape.n_images * (shape.height // p) * (shape.width // p)
    pixels = g.input("pixels", (shape.n_images, 3, shape.height, shape.width), F32)
    x = g.patchify(pixels, p, "inp_patches")  # (n, 3 * p * p), channel-major as the converter orders the columns
    x = build_layer_norm(g, x, w("v.patch_norm.1.weight", (3 * p * p,)), w("v.patch_norm.1.bias", (3 * p * p,)),
                         eps=LN_EPS, name="patch_norm_1")
    x = g.add(g.mul_mat(w("v.patch_embd.weight", (e, 3 * p * p)), x, "inp"), w("v.patch_embd.bias", (e,)), "inp_b")
    x = build_layer_norm(g, x, w("v.patch_norm.2.weight", (e,)), w("v.patch_norm.2.bias", (e,)), eps=LN_EPS,
                         name="patch_norm_2")
    x = g.add(x, g.get_rows(w(POS_X, (pc.n_pos, e)), g.input("pos_x", (n,)), "emb_x"), "inp_pos_x")
    x = g.add(x, g.get_rows(w(POS_Y, (pc.n_pos, e)), g.input("pos_y", (n,)), "emb_y"), "pos_embd")
    x = build_layer_norm(g, x, w("v.patch_norm.3.weight", (e,)), w("v.patch_norm.3.bias", (e,)), eps=LN_EPS,
                         name="pos_norm")
    x = g.rms_norm(x, c.eps, "mm_inp_normed")  # Gemma4UnifiedMultimodalEmbedder's norm: no weight
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else e
    return g.mul_mat(w("mm.input_projection.weight", (n_text, e)), x, "projected")
