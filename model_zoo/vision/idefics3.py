"""SmolVLM's and Idefics3's projector (llama.cpp tools/mtmd/models/siglip.cpp, PROJECTOR_TYPE_IDEFICS3): a SigLIP
tower over image_size x image_size tiles (the learned positions as they are), the pixel shuffle
(merge.build_merge: each s x s cell of patches one row) and mm.model.fc into the text model's width.
An image (clip.cpp's idefics3 preprocessing, Lanczos) becomes grid_y x grid_x tiles plus an overview, each
its own image chunk, laid out as mtmd's MTMD_SLICE_TMPL_IDEFICS3 (no begin or end marker):

    <fake_token_around_image><row_1_col_1> (tile) <fake_token_around_image><row_1_col_2> (tile) \\n
    <fake_token_around_image><row_2_col_1> (tile) ...                       (no \\n after the last row)
    \\n\\n <fake_token_around_image> <global-img> (overview) <fake_token_around_image>

the row markers tokenized as text with special tokens parsed, the others looked up by their text (Piece);
rows attend causally."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import Graph, Tensor
from hearthlm.model_zoo.vision.clip import Piece
from hearthlm.model_zoo.vision.conv import half, half_kernel
from hearthlm.model_zoo.vision.merge import build_merge, merge_inputs
from hearthlm.model_zoo.vision.preprocess import preprocess_idefics3
from hearthlm.model_zoo.vision.vit import build_tower
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "", ""  # mtmd's img_beg / img_end: none for idefics3
BIDIRECTIONAL = False
AROUND, GLOBAL = "<fake_token_around_image>", "<global-img>"
TILE = AROUND + "<row_{}_col_{}>"  # mtmd's sli_img_start_tmpl, 1-based
TOKENS = ("\n", "\n\n", AROUND, GLOBAL)  # mtmd's lookup_token: tok_row_end, tok_ov_img_start / _end
FC = "mm.model.fc.weight"


@dataclass(frozen=True)
class Config:
    n_merge: int       # patches per side shuffled into one row (clip.vision.projector.scale_factor)
    longest_edge: int  # the image's longest side before tiling (clip.vision.preproc_image_size; 0: an old file)

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        s, side = c.scale_factor, c.image_size // c.patch_size
        if s < 2:  # clip.cpp's n_merge defaults to 1, which build_patch_merge_permute refuses
            raise ModelLoadError(f"{where}: the idefics3 projector needs clip.vision.projector.scale_factor of 2 "
                                 f"or more, not {s}")
        if side % s:  # clip.cpp counts side^2 / s^2 rows but its graph pads to whole cells: no file does this
            raise ModelLoadError(f"{where}: {side}x{side} patches a tile do not shuffle into cells of {s}")
        for name in (FC, "v.patch_embd.weight"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (idefics3 projector)")
        half_kernel(weights, "v.patch_embd.weight", where)
        return cls(n_merge=s, longest_edge=int(md.get("clip.vision.preproc_image_size", 0)))


def n_embd_out(c, pc: Config, weights) -> int:
    return int(weights[FC].shape[0])


def layout(c, pc: Config, pixels) -> list:
    """The image's tiles and overview (float32 (3, S, S) each, at half precision as the patch embedding reads
    them) between their markers, in prompt order."""
    pre = preprocess_idefics3(pixels, image_size=c.image_size, patch_size=c.patch_size, longest_edge=pc.longest_edge,
                              mean=c.mean, std=c.std)
    out: list = []
    for y in range(pre.grid_y):
        for x in range(pre.grid_x):
            out += [TILE.format(y + 1, x + 1), half(pre.slices[y * pre.grid_x + x])]
        if y != pre.grid_y - 1:
            out.append(Piece("\n"))
    return out + [Piece("\n\n"), Piece(AROUND), Piece(GLOBAL), half(pre.overview), Piece(AROUND)]


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    return (height // c.patch_size // pc.n_merge) * (width // c.patch_size // pc.n_merge)


def inputs(c, pc: Config, pixels):
    """The tower's inputs (each patch's position row and image) and the shuffle's."""
    p, b = c.patch_size, pixels.shape[0]
    ny, nx = pixels.shape[2] // p, pixels.shape[3] // p
    n = ny * nx
    return dict(patch_pos=np.tile(np.arange(n, dtype=np.int32), b), seg=np.repeat(np.arange(b, dtype=np.int32), n),
                **merge_inputs(b, ny, nx, pc.n_merge))


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    x = build_tower(c, g, w, shape, may_swap_ffn=True)
    p, s = c.patch_size, pc.n_merge
    x = build_merge(g, x, n_images=shape.n_images, ny=shape.height // p, nx=shape.width // p, s=s)
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else c.n_embd
    return g.mul_mat(w(FC, (n_text, s * s * c.n_embd)), x, "mm_proj")
