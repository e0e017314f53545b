"""LFM2-VL's projector (llama.cpp tools/mtmd/models/siglip.cpp, PROJECTOR_TYPE_LFM2): a SigLIP2 NaFlex tower whose
learned positions (a side x side table) are resized to each image's patch grid (clip.cpp's
resize_position_embeddings: ggml_interpolate, bilinear with antialiasing, pixel centres; computed here on the
host once per grid and fed as an input), the pixel unshuffle (merge.build_merge), an optional LayerNorm
(mm.input_norm, eps 1e-5) and a GELU MLP (mm.1, mm.2) into the text model's width.
A small image (clip.cpp's lfm2 preprocessing: smart-resized, sides multiples of patch * merge, 64 to 256 rows)
is one image chunk between <|image_start|> and <|image_end|>; a large one (more than twice the largest area)
becomes 512 x 512 tiles plus the smart-resized image as a thumbnail, each its own chunk (mtmd's
MTMD_SLICE_TMPL_LFM2):

    <|image_start|> <|img_row_1_col_1|> (tile) <|img_row_1_col_2|> (tile) ... <|img_thumbnail|> (thumbnail) <|image_end|>

the markers tokenized as text with special tokens parsed, <|img_thumbnail|> looked up by its text (Piece);
rows attend causally."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.model_zoo.blocks import build_layer_norm
from hearthlm.model_zoo.vision.clip import Piece
from hearthlm.model_zoo.vision.conv import half, half_kernel
from hearthlm.model_zoo.vision.merge import build_merge, cells, merge_inputs
from hearthlm.model_zoo.vision.preprocess import preprocess_lfm2, token_limits
from hearthlm.model_zoo.vision.vit import build_tower, linear
from hearthlm.runtime.vision import ImageBatch

BEGIN, END = "<|image_start|>", "<|image_end|>"  # mtmd's img_beg / img_end for LFM2
BIDIRECTIONAL = False
TILE = "<|img_row_{}_col_{}|>"  # mtmd's sli_img_start_tmpl, 1-based
THUMBNAIL = "<|img_thumbnail|>"
TOKENS = (THUMBNAIL,)  # mtmd's lookup_token: tok_ov_img_start
MIN_TOKENS, MAX_TOKENS = 64, 256  # clip.cpp's set_limit_image_tokens for LFM2
NORM_EPS = 1e-5  # ggml_norm's in siglip.cpp (nn.LayerNorm's default)
RESIZED_KEPT = 16  # resized position tables kept (a thumbnail's grid varies with the image; tiles' is one)


@dataclass(frozen=True, eq=False)
class Config:
    n_merge: int     # patches per side unshuffled into one row (clip.vision.projector.scale_factor)
    min_pixels: int  # the smart-resized image's area bounds
    max_pixels: int
    pos_table: np.ndarray = field(repr=False)  # (side, side, n_embd) float32: v.position_embd as a grid
    _resized: dict = field(default_factory=dict, repr=False)  # (ny, nx) -> the table resized

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        s = c.scale_factor
        if s < 2:  # clip.cpp's n_merge defaults to 1, which build_patch_merge_permute refuses
            raise ModelLoadError(f"{where}: the lfm2 projector needs clip.vision.projector.scale_factor of 2 or "
                                 f"more, not {s}")
        for name in ("v.patch_embd.weight", "v.position_embd.weight", "mm.1.weight", "mm.2.weight"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (lfm2 projector)")
        if "mm.input_norm.bias" in weights and "mm.input_norm.weight" not in weights:
            raise ModelLoadError(f"{where}: mm.input_norm.bias without mm.input_norm.weight (lfm2 projector)")
        half_kernel(weights, "v.patch_embd.weight", where)
        qw = weights["v.position_embd.weight"]
        if qw.ggml_type != 0:
            raise ModelLoadError(f"{where}: v.position_embd.weight is ggml type {qw.ggml_type}, not F32 (lfm2)")
        table = qw.raw.view(np.float32).reshape(qw.shape)
        side = int(round(np.sqrt(table.shape[0])))
        if side * side != table.shape[0] or table.shape[1] != c.n_embd:
            raise ModelLoadError(f"{where}: v.position_embd.weight {table.shape} is not a square grid of "
                                 f"{c.n_embd}-wide rows")
        lo, hi = token_limits(MIN_TOKENS, MAX_TOKENS, patch_size=c.patch_size, n_merge=s)
        return cls(n_merge=s, min_pixels=lo, max_pixels=hi, pos_table=table.reshape(side, side, c.n_embd))

    def positions(self, ny: int, nx: int) -> np.ndarray:
        """(ny * nx, E): the table resized to the grid (resize_positions), the last RESIZED_KEPT grids' kept."""
        t = self._resized.pop((ny, nx), None)
        if t is None:
            t = resize_positions(self.pos_table, ny, nx)
        self._resized[(ny, nx)] = t  # the newest last (dicts keep insertion order)
        while len(self._resized) > RESIZED_KEPT:
            del self._resized[next(iter(self._resized))]
        return t


def n_embd_out(c, pc: Config, weights) -> int:
    return int(weights["mm.2.weight"].shape[0])


def layout(c, pc: Config, pixels) -> list:
    """The image (or its tiles and thumbnail), float32 (3, H, W) at half precision as the patch embedding reads
    them, between their markers in prompt order."""
    pre = preprocess_lfm2(pixels, patch_size=c.patch_size, n_merge=pc.n_merge, min_pixels=pc.min_pixels,
                          max_pixels=pc.max_pixels, mean=c.mean, std=c.std)
    if pre.overview is None:
        return [BEGIN, half(pre.slices[0]), END]
    out: list = [BEGIN]
    for y in range(pre.grid_y):
        for x in range(pre.grid_x):
            out += [TILE.format(y + 1, x + 1), half(pre.slices[y * pre.grid_x + x])]
    return out + [Piece(THUMBNAIL), half(pre.overview), END]


def grid(c, pc: Config, height: int, width: int) -> tuple[int, int]:
    p = c.patch_size
    return cells(width // p, pc.n_merge), cells(height // p, pc.n_merge)


def n_tokens(c, pc: Config, height: int, width: int) -> int:
    nx, ny = grid(c, pc, height, width)
    return nx * ny


def resize_positions(table: np.ndarray, ny: int, nx: int) -> np.ndarray:
    """The (side, side, E) table at (ny, nx), (ny * nx, E) row-major: ggml_interpolate's bilinear with
    antialiasing (GGML_SCALE_MODE_BILINEAR | GGML_SCALE_FLAG_ANTIALIAS, ggml-cpu's upscale): a triangle filter
    widened by the downscale factor around each output's pixel centre, the taps within the table, weighted
    sums divided by the weights' sum; float32 and the taps in ggml's order (bit for bit ggml's on this machine's
    build). The table at its own size as is."""
    side = table.shape[0]
    if (ny, nx) == (side, side):
        return table.reshape(side * side, -1)
    f32 = np.float32

    def axis(n_out: int):  # per output: the taps' first index and count, and each tap's weight
        sf = f32(n_out) / f32(side)
        support = max(f32(1), f32(1) / sf)
        inv = f32(1) / support
        centre = (np.arange(n_out, dtype=f32) + f32(0.5)) / sf
        lo = np.maximum((centre - support + f32(0.5)).astype(np.int64), 0)  # C's cast truncates toward zero
        hi = np.minimum((centre + support + f32(0.5)).astype(np.int64), side)
        k = np.arange(int((hi - lo).max()))
        at = lo[:, None] + k[None, :]  # (n_out, taps)
        w = np.maximum(f32(1) - np.abs((at.astype(f32) - centre[:, None] + f32(0.5)) * inv), f32(0))
        w = np.where(at < hi[:, None], w, f32(0)).astype(f32)
        return np.minimum(at, side - 1), w

    ay, wy = axis(ny)
    ax, wx = axis(nx)
    val = np.zeros((ny, nx, table.shape[2]), f32)
    total = np.zeros((ny, nx), f32)
    for ky in range(ay.shape[1]):  # sy outer, sx inner, as the C loops add them
        for kx in range(ax.shape[1]):
            w = (wx[None, :, kx] * wy[:, ky, None]).astype(f32)  # weight_x * weight_y; <= 0: skipped (adds 0)
            w = np.where(w > 0, w, f32(0))
            # val += pixel * weight, which ggml-cpu's build contracts to a fused multiply-add: one rounding
            val = (table[ay[:, ky][:, None], ax[:, kx][None, :]].astype(np.float64) * w[:, :, None] + val).astype(f32)
            total += w
    out = np.where(total[:, :, None] > 0, val / np.where(total > 0, total, f32(1))[:, :, None], val)
    return out.reshape(ny * nx, -1).astype(f32)


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """The tower's inputs besides the pixels (B, 3, H, W): each patch's resized position row and image, and the
    unshuffle's."""
    p, b = c.patch_size, pixels.shape[0]
    ny, nx = pixels.shape[2] // p, pixels.shape[3] // p
    return dict(pos_embd=np.tile(pc.positions(ny, nx), (b, 1)), seg=np.repeat(np.arange(b, dtype=np.int32), ny * nx),
                **merge_inputs(b, ny, nx, pc.n_merge))


def _embed(c, g: Graph, w, *, n_images: int, height: int, width: int) -> tuple[Tensor, Tensor | None]:
    """Pixels -> patch embeddings, plus the bias and the resized positions (input "pos_embd")."""
    p, e = c.patch_size, c.n_embd
    n = n_images * (height // p) * (width // p)
    pixels = g.input("pixels", (n_images, 3, height, width), F32)
    x = g.mul_mat(w("v.patch_embd.weight", (e, 3 * p * p)), g.patchify(pixels, p, "inp_patches"), "inp_embd")
    b = w("v.patch_embd.bias", (e,), optional=True)
    if b is not None:
        x = g.add(x, b, "patch_bias")
    x = g.add(x, g.input("pos_embd", (n, e), F32), "pos_embed")
    return x, g.input("seg", (n,)) if n_images > 1 else None


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    x = build_tower(c, g, w, shape, embed=_embed)
    p, s = c.patch_size, pc.n_merge
    x = build_merge(g, x, n_images=shape.n_images, ny=shape.height // p, nx=shape.width // p, s=s)
    m = x.shape[1]
    norm = w("mm.input_norm.weight", (m,), optional=True)
    if norm is not None:
        x = build_layer_norm(g, x, norm, w("mm.input_norm.bias", (m,), optional=True), eps=NORM_EPS, name="mm_norm")
    L = lambda name, shape_, **kw: w(name, shape_, **kw)  # noqa: E731
    n_mid = w.shape_of("mm.1.weight")[0]
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else c.n_embd
    y = g.gelu(linear(g, L, "mm.1", x, (n_mid, m), -1), "mm_gelu")
    return linear(g, L, "mm.2", y, (n_text, n_mid), -1)
