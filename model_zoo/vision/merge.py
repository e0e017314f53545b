"""The patch merge of the tiled towers (llama.cpp tools/mtmd/clip.cpp's build_patch_merge_permute: idefics3's
pixel shuffle, lfm2's pixel unshuffle, Kimi-VL's patch merger): each s x s cell of the patch grid becomes one
row, its patches side by side. Derived from the ggml reshapes and permutes: the output row (Y, X), row-major
over the cells, is the concatenation over dy, then dx, of the patches (Y*s + dy, X*s + dx); a grid that is not
a multiple of s is padded at its right and bottom with zero patches (ggml_pad). Here a get_rows with the
permutation (`merge_order`, an input) and a reshape; where the grid pads, the padded rows are zeroed by a mask."""
from __future__ import annotations

import numpy as np

from hearthlm.core.graph import F32, Graph, Tensor


def cells(n: int, s: int) -> int:
    """Cells along a side of n patches (CLIP_ALIGN(n, s) / s)."""
    return -(-n // s)


def merge_order(ny: int, nx: int, s: int) -> tuple[np.ndarray, np.ndarray | None]:
    """For a grid of ny x nx patches (row-major): the patch index of each merged row's s*s parts, in the output's
    order (cells row-major, inside each cell dy then dx), and, where the grid pads, a (n, 1) float32 mask of the
    parts that are patches (1) or padding (0, their index 0); else None."""
    cy, cx = cells(ny, s), cells(nx, s)
    y, x, dy, dx = np.meshgrid(np.arange(cy) * s, np.arange(cx) * s, np.arange(s), np.arange(s), indexing="ij")
    py, px = (y + dy).reshape(-1), (x + dx).reshape(-1)
    inside = (py < ny) & (px < nx)
    order = np.where(inside, py * nx + px, 0).astype(np.int32)
    return order, (None if inside.all() else inside.astype(np.float32)[:, None])


def merge_inputs(n_images: int, ny: int, nx: int, s: int) -> dict[str, np.ndarray]:
    """The graph's inputs for n_images images of one grid: "merge_order" over the batch's rows, and "merge_keep"
    where the grid pads."""
    order, keep = merge_order(ny, nx, s)
    out = {"merge_order": (order[None, :] + ny * nx * np.arange(n_images, dtype=np.int32)[:, None]).reshape(-1)}
    if keep is not None:
        out["merge_keep"] = np.tile(keep, (n_images, 1))
    return out


def build_merge(g: Graph, x: Tensor, *, n_images: int, ny: int, nx: int, s: int) -> Tensor:
    """(n_images * ny * nx, E) patches -> (n_images * cells, s * s * E) merged rows."""
    e, n_out = x.shape[1], n_images * cells(ny, s) * cells(nx, s)
    x = g.get_rows(x, g.input("merge_order", (n_out * s * s,)), "merge_rows")
    if ny % s or nx % s:  # ggml_pad's zero patches
        x = g.mul(x, g.input("merge_keep", (n_out * s * s, 1), F32), "merge_pad")
    return g.reshape(x, (n_out, s * s * e), "pixel_shuffle")
