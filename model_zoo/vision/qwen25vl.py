"""Qwen2.5-VL's projector (llama.cpp tools/mtmd/models/qwen2vl.cpp, PROJECTOR_TYPE_QWEN25VL,
"qwen2.5vl_merger"): Qwen3-VL's patch embedding (the two temporal kernels summed, patches in 2x2
blocks) without bias or learned positions, RMS norms, 2D RoPE, gated SiLU FFNs, and window attention:
the 2x2 blocks reordered window by window (windows of 112 pixels, clip.cpp's default, as the converter
writes no size: 4x4 merged rows at patch 14; cut at the grid's edges), each windowed layer attending
within a window, every n_wa_pattern-th layer (il + 1 divisible by it) over the whole image; then the
RMS post-norm, each block's patches side by side through the merger's MLP (GELU), and the rows put
back in raster order. Preprocessing, limits, markers and grid as Qwen3-VL's (qwen3vl.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.blocks import build_norm
from hearthlm.model_zoo.rope import vision_rope
from hearthlm.model_zoo.vision import qwen3vl
from hearthlm.model_zoo.vision.conv import floats, half
from hearthlm.model_zoo.vision.preprocess import token_limits
from hearthlm.model_zoo.vision.vit import build_attn_full, build_tower, linear
from hearthlm.runtime.vision import ImageBatch

BEGIN, END, BIDIRECTIONAL = qwen3vl.BEGIN, qwen3vl.END, False
WINDOW_PIXELS = 112  # clip.cpp's attn_window_size default (it reads none for qwen2.5vl_merger)
PATCH_SUM = qwen3vl.PATCH_SUM
preprocess, grid, n_tokens, merge_order = qwen3vl.preprocess, qwen3vl.grid, qwen3vl.n_tokens, qwen3vl.merge_order


@dataclass(frozen=True)
class Config:
    n_merge: int       # 2 (clip.vision.spatial_merge_size)
    min_pixels: int    # dyn_size's bounds on the resized image's area
    max_pixels: int
    n_wa_pattern: int  # clip.vision.n_wa_pattern: layer il attends over the whole image where (il + 1) % it == 0
    window: int        # merged rows per window side

    @classmethod
    def read(cls, c, md, weights, where: str) -> "Config":
        k = int(md.get("clip.vision.spatial_merge_size", 2))
        if k != 2:
            raise ModelLoadError(f"{where}: clip.vision.spatial_merge_size {k}: the qwen2.5vl_merger projector merges 2x2")
        if "clip.vision.n_wa_pattern" not in md:  # clip.cpp requires it of this projector
            raise ModelLoadError(f"{where}: the qwen2.5vl_merger mmproj has no clip.vision.n_wa_pattern")
        pattern = int(md["clip.vision.n_wa_pattern"])
        if pattern < 0:
            raise ModelLoadError(f"{where}: clip.vision.n_wa_pattern {pattern} is negative")
        for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            if name not in weights:
                raise ModelLoadError(f"{where}: tensor {name!r} is missing (qwen2.5vl_merger projector)")
        w0, w1 = (half(floats(weights[n], where)) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1"))
        if w0.shape != w1.shape:
            raise ModelLoadError(f"{where}: the temporal patch kernels differ in shape: {w0.shape}, {w1.shape}")
        both = np.ascontiguousarray(w0 + w1, np.float32)
        weights[PATCH_SUM] = QWeight(PATCH_SUM, 0, both.shape, both.view(np.uint8))
        window = WINDOW_PIXELS // c.patch_size // k
        if window < 1:
            raise ModelLoadError(f"{where}: patch size {c.patch_size} is over the {WINDOW_PIXELS}-pixel window")
        lo, hi = token_limits(qwen3vl.MIN_TOKENS, qwen3vl.MAX_TOKENS, patch_size=c.patch_size, n_merge=k)
        return cls(n_merge=k, min_pixels=lo, max_pixels=hi, n_wa_pattern=pattern, window=window)

    def full(self, il: int) -> bool:
        """Whether layer il attends over the whole image (qwen2vl.cpp's full_attn)."""
        return self.n_wa_pattern == 0 or (il + 1) % self.n_wa_pattern == 0


def n_embd_out(c, pc: Config, weights) -> int:
    t = weights.get("mm.2.weight")
    return int(t.shape[0]) if t is not None else 0


def windows(ny: int, nx: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, win) over the (ny, nx) merged rows: the row-major indices window by window (windows of
    w x w row-major, each's rows row-major: clip.cpp's inv_window_idx), and each one's window number."""
    order, win = [], []
    for y in range(0, ny, w):
        for x in range(0, nx, w):
            r = [(y + dy) * nx + x + dx for dy in range(min(w, ny - y)) for dx in range(min(w, nx - x))]
            win += [win[-1] + 1 if win else 0] * len(r)
            order += r
    return np.asarray(order, np.int32), np.asarray(win, np.int32)


def inputs(c, pc: Config, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """The patches in window order (each merged row's four together, windows one after another), their
    (y, x, y, x) for the 2D RoPE, their image (seg) and window (win_seg, unique over the batch), and
    where each image's merged row lies in window order (window_idx: the rows back to raster order)."""
    b, ny, nx = pixels.shape[0], pixels.shape[2] // c.patch_size, pixels.shape[3] // c.patch_size
    m = pc.n_merge * pc.n_merge
    order, win = windows(ny // pc.n_merge, nx // pc.n_merge, pc.window if pc.n_wa_pattern else max(ny, nx))
    patches = merge_order(ny, nx).reshape(-1, m)[order].reshape(-1)  # blocks in window order
    y, x = np.divmod(patches, nx)
    n, rows, n_win = ny * nx, len(order), int(win.max()) + 1
    back = np.empty_like(order)
    back[order] = np.arange(rows, dtype=np.int32)  # clip.cpp's window_idx
    at = np.arange(b, dtype=np.int32)[:, None]
    return dict(merge_order=(patches[None, :] + n * at).reshape(-1),
                patch_yx=np.tile(np.stack([y, x, y, x], axis=1).astype(np.int32), (b, 1)),
                seg=np.repeat(np.arange(b, dtype=np.int32), n),
                win_seg=(np.repeat(win, m)[None, :] + n_win * at).reshape(-1),
                window_idx=(back[None, :] + rows * at).reshape(-1))


def _embed(c, g: Graph, w, *, n_images: int, height: int, width: int) -> tuple[Tensor, Tensor | None]:
    """Pixels -> patch embeddings in window order (no bias, no learned positions)."""
    p, e = c.patch_size, c.n_embd
    n = n_images * (height // p) * (width // p)
    pixels = g.input("pixels", (n_images, 3, height, width), F32)
    x = g.mul_mat(w(PATCH_SUM, (e, 3 * p * p)), g.patchify(pixels, p, "inp_patches"), "inp_embd")
    x = g.get_rows(x, g.input("merge_order", (n,)), "inp_windowed")
    pre = w("v.pre_ln.weight", (e,), optional=True)
    return (x if pre is None else _rms(g, w, x, "v.pre_ln", e, c.eps, -1)), g.input("seg", (n,)) if n_images > 1 else None


def _rms(g: Graph, w, x: Tensor, name: str, e: int, eps: float, il: int) -> Tensor:
    """clip.cpp's build_norm of NORM_TYPE_RMS: RMSNorm, the weight, a bias where the file has one."""
    y = build_norm(g, x, w(f"{name}.weight", (e,)), eps=eps, name=name.split(".")[-1], il=il)
    b = w(f"{name}.bias", (e,), optional=True)
    return y if b is None else g.add(y, b, f"{name}_b", il)


def build(c, pc: Config, g: Graph, w, shape: ImageBatch) -> Tensor:
    p, e, f = c.patch_size, c.n_embd, c.n_ff
    n = shape.n_images * (shape.height // p) * (shape.width // p)
    yx, win = g.input("patch_yx", (n, 4)), g.input("win_seg", (n,))
    r = vision_rope(c.head_dim)

    def rope(q, k, il):
        return g.rope(q, yx, name="Qcur_rope", il=il, **r), g.rope(k, yx, name="Kcur_rope", il=il, **r)

    def body(c, g, w, x, *, seg, layers, **_):
        for il in layers:
            L = lambda name, shape_, **kw: w(f"v.blk.{il}.{name}", shape_, **kw)  # noqa: E731
            h = _rms(g, w, x, f"v.blk.{il}.ln1", e, c.eps, il)
            a = build_attn_full(c, g, L, h, seg=seg if pc.full(il) else win, il=il, rope=rope)
            x = g.add(x, a, "ffn_inp", il)
            h = _rms(g, w, x, f"v.blk.{il}.ln2", e, c.eps, il)
            gate = g.silu(linear(g, L, "ffn_gate", h, (f, e), il), "ffn_silu", il)
            y = g.mul(gate, linear(g, L, "ffn_up", h, (f, e), il), "ffn_swiglu", il)
            x = g.add(x, linear(g, L, "ffn_down", y, (e, f), il), "layer_out", il)
        return _rms(g, w, x, "v.post_ln", e, c.eps, c.n_layer) if layers.stop == c.n_layer else x

    x = build_tower(c, g, w, shape, embed=_embed, body=body)
    k2 = pc.n_merge * pc.n_merge
    x = g.reshape(x, (n // k2, k2 * e), "merged")
    n_text = n_embd_out(c, pc, w.tensors) if w.tensors is not None else c.n_embd
    L = lambda name, shape_, **kw: w(name, shape_, **kw)  # noqa: E731
    x = linear(g, L, "mm.2", g.gelu(linear(g, L, "mm.0", x, (k2 * e, k2 * e), -1), "mm.0_gelu", -1),
               (n_text, k2 * e), -1)
    return g.get_rows(x, g.input("window_idx", (n // k2,)), "rows_raster")
