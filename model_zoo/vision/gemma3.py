"""Gemma 3's projector (llama.cpp tools/mtmd/models/siglip.cpp, PROJECTOR_TYPE_GEMMA3): a SigLIP
tower, its patches averaged over n_merge x n_merge cells (4 unless the file says), RMS-normed
(mm.soft_emb_norm) and projected into the text model's embeddings (mm.input_projection, stored
transposed). The image is fitted into image_size square (bilinear, letterboxed in black) and its rows
attend to each other both ways in the text model (mtmd_decode_use_non_causal)."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.graph import Graph, Tensor
from hearthlm.model_zoo.blocks import build_norm
from hearthlm.model_zoo.vision.clip import conv_half, half_kernel, transposed
from hearthlm.model_zoo.vision.preprocess import preprocess_fixed
from hearthlm.model_zoo.vision.vit import build_tower
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "<start_of_image>", "<end_of_image>"  # mtmd's img_beg / img_end, tokenized around the rows
BIDIRECTIONAL = True
RESIZE = "bilinear"


@dataclass(frozen=True)
class Config:
    n_merge: int  # patches per side pooled into one row

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        k = c.scale_factor or 4
        side = c.image_size // c.patch_size
        if side % k:
            from hearthlm.core.errors import ModelLoadError
            raise ModelLoadError(f"{where}: {side}x{side} patches do not pool into cells of {k}")
        weights["mm.input_projection.weight.T"] = transposed(weights["mm.input_projection.weight"]) \
            if "mm.input_projection.weight" in weights else None
        half_kernel(weights, "v.patch_embd.weight")
        return cls(n_merge=k)


def n_embd_out(c, pc: Config, weights) -> int:
    t = weights.get("mm.input_projection.weight.T")
    return int(t.shape[0]) if t is not None else 0


def preprocess(c, pc: Config, pixels):
    """(H, W, 3) uint8 -> (3, S, S) float32: fitted into image_size square (bilinear), letterboxed."""
    return conv_half(preprocess_fixed(pixels, size=c.image_size, patch_size=c.patch_size, mean=c.mean, std=c.std,
                                      algo=RESIZE).slices[0])  # the patch embedding's F16 inputs (clip.conv_half)


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    side = c.image_size // c.patch_size // pc.n_merge
    return side * side


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    side = shape.height // c.patch_size
    x = build_tower(c, g, w, shape, may_swap_ffn=True)
    x = g.pool_2d(x, nx=side, ny=side, k=pc.n_merge, name="pooled")
    x = build_norm(g, x, w("mm.soft_emb_norm.weight", (c.n_embd,)), eps=c.eps, name="soft_emb_norm")
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else c.n_embd
    return g.mul_mat(w("mm.input_projection.weight.T", (n_text, c.n_embd)), x, "mm_proj")
