"""Image preprocessing for vision towers, ported from llama.cpp's tools/mtmd/mtmd-image.cpp.

Every step copies llama.cpp's arithmetic, so that a tower sees the floats libmtmd would give it:
- `resize`: img_tool::resize_pillow, a port of Pillow's separable resampler (bilinear, bicubic
  with a = -0.5, Lanczos-3): horizontal pass first, weights in 22-bit fixed point, each pass
  rounded to uint8. Vectorized: the taps of each axis are computed once, then applied as
  gather-and-sum over whole rows.
- `resize_padded`: img_tool::resize with its pad styles ("none" stretches; "ceil" and "nearest"
  keep the aspect ratio and centre the result on a solid colour).
- `smart_resize`: img_tool::calc_size_preserved_ratio, in float32 as the C++ computes it.
- `normalize`: clip_image_f32::from_u8 then normalize: (x / 255 - mean) / std in float32.

The preprocess_* functions are the preprocessor families (mtmd_image_preprocessor_*), one per
family, hparams as keyword arguments. Each returns a `Preprocessed`: float32 arrays laid out
(3, H, W), channel-first, as clip.cpp lays out its "inp_raw" input tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

import numpy as np

from hearthlm.core.errors import InvalidRequestError

ResizeAlgo = Literal["bilinear", "bicubic", "lanczos"]
PadStyle = Literal["none", "ceil", "nearest"]

_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}
_PRECISION_BITS = 32 - 8 - 2  # Pillow's: 8-bit pixels times 22-bit weights fit an int32
_MAX_SIDE = 65536  # resize_pillow refuses larger targets
_ACC_BYTES = 1 << 20  # int32 accumulator per chunk of rows: stays in cache across the taps


# ---- the resampler (img_tool::resize_pillow) ----

def _filter(algo: str, x: np.ndarray) -> np.ndarray:
    """Pillow's filter kernels, in float64 as Resample.c evaluates them."""
    if algo == "lanczos":
        # libm's sin, as the C code calls it (numpy's may differ in the last bit)
        sin = np.frompyfunc(math.sin, 1, 1)
        def sinc(v: np.ndarray) -> np.ndarray:
            pv = v * 3.141592653589793
            safe = np.where(v == 0.0, 1.0, pv)
            return np.where(v == 0.0, 1.0, sin(safe).astype(np.float64) / safe)
        return np.where((x >= -3.0) & (x < 3.0), sinc(x) * sinc(x / 3.0), 0.0)
    x = np.abs(x)
    if algo == "bilinear":
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5  # Pillow's bicubic (ggml and PyTorch use -0.75)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))


@lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int, algo: str) -> tuple[np.ndarray, np.ndarray]:
    """precompute_weights for one axis: for tap k of output pixel i, the input index
    idx[k, i] and the fixed-point weight w[k, i] (zero past the pixel's own count)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)  # widen the filter only when shrinking
    support = _SUPPORT[algo] * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)  # C casts truncate
    count = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
    k = np.arange(ksize)[:, None]
    x = ((xmin + k).astype(np.float64) - center + 0.5) * (1.0 / filterscale)
    w = np.where(k < count, _filter(algo, x), 0.0)
    ww = np.zeros(out_size)
    for row in w:  # summed in order, as the C loop does (np.sum pairs terms differently)
        ww += row
    w = np.where(ww != 0.0, w / np.where(ww != 0.0, ww, 1.0), w)
    # round half away from zero, then truncate: Pillow's normalize_coeffs_8bpc
    fixed = np.trunc(w * float(1 << _PRECISION_BITS) + np.where(w < 0, -0.5, 0.5)).astype(np.int32)
    idx = np.minimum(xmin + k, in_size - 1)
    idx.setflags(write=False)
    fixed.setflags(write=False)
    return idx, fixed


def _finish(acc: np.ndarray) -> np.ndarray:
    acc >>= _PRECISION_BITS
    np.clip(acc, 0, 255, out=acc)
    return acc.astype(np.uint8)


def _horizontal(flat: np.ndarray, width: int, out_w: int, algo: str) -> np.ndarray:
    """(H, W*3) uint8 -> (H, out_w*3): each tap gathers one column per output pixel and channel."""
    idx, w = _taps(width, out_w, algo)
    cols = (idx[:, :, None] * 3 + np.arange(3)).reshape(len(idx), -1)  # (ksize, out_w*3)
    w3 = np.repeat(w, 3, axis=1)
    out = np.empty((flat.shape[0], out_w * 3), np.uint8)
    step = max(1, _ACC_BYTES // (out_w * 12))
    for r0 in range(0, flat.shape[0], step):
        part = flat[r0:r0 + step]
        acc = np.full((part.shape[0], out_w * 3), 1 << (_PRECISION_BITS - 1), np.int32)
        tmp = np.empty_like(acc)
        for k in range(len(idx)):
            np.multiply(np.take(part, cols[k], axis=1), w3[k], out=tmp)
            acc += tmp
        out[r0:r0 + step] = _finish(acc)
    return out


def _vertical(flat: np.ndarray, height: int, out_h: int, algo: str) -> np.ndarray:
    """(H, W*3) uint8 -> (out_h, W*3): each tap gathers one whole input row per output row."""
    idx, w = _taps(height, out_h, algo)
    out = np.empty((out_h, flat.shape[1]), np.uint8)
    step = max(1, _ACC_BYTES // (flat.shape[1] * 4))
    for r0 in range(0, out_h, step):
        r1 = min(r0 + step, out_h)
        acc = np.full((r1 - r0, flat.shape[1]), 1 << (_PRECISION_BITS - 1), np.int32)
        tmp = np.empty_like(acc)
        for k in range(len(idx)):
            np.multiply(flat[idx[k, r0:r1]], w[k, r0:r1, None], out=tmp)
            acc += tmp
        out[r0:r1] = _finish(acc)
    return out


def _check_rgb(pixels: np.ndarray) -> np.ndarray:
    pixels = getattr(pixels, "pixels", pixels)  # an image.Image
    if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise TypeError(f"expected (H, W, 3) uint8 pixels, got {type(pixels).__name__} "
                        f"{getattr(pixels, 'shape', '')} {getattr(pixels, 'dtype', '')}")
    if pixels.shape[0] == 0 or pixels.shape[1] == 0:
        raise InvalidRequestError(f"image is empty ({pixels.shape[1]}x{pixels.shape[0]})")
    return pixels


def resize(pixels: np.ndarray, *, width: int, height: int, algo: ResizeAlgo) -> np.ndarray:
    """(H, W, 3) uint8 -> (height, width, 3) uint8, byte for byte as clip.cpp's resize_pillow
    (and Pillow's Image.resize done one axis at a time, width first)."""
    pixels = _check_rgb(pixels)
    if algo not in _SUPPORT:
        raise ValueError(f"unknown resize algorithm {algo!r} (expected one of {sorted(_SUPPORT)})")
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE):
        raise InvalidRequestError(f"resize target {width}x{height} is out of range (1 to {_MAX_SIDE} a side)")
    in_h, in_w = pixels.shape[:2]
    if (width, height) == (in_w, in_h):
        return pixels.copy()
    flat = np.ascontiguousarray(pixels).reshape(in_h, in_w * 3)
    if width != in_w:
        flat = _horizontal(flat, in_w, width, algo)
    if height != in_h:
        flat = _vertical(flat, in_h, height, algo)
    return flat.reshape(height, width, 3)


def _round_half_away(x: np.float32) -> int:
    """C's std::round on a float: halves go away from zero (numpy's round goes to even)."""
    x = np.float32(x)
    if x < 0:
        return -_round_half_away(-x)
    fl = np.floor(x)
    return int(fl) + (1 if x - fl >= np.float32(0.5) else 0)  # x - floor(x) is exact in float32


def resize_padded(pixels: np.ndarray, *, width: int, height: int, algo: ResizeAlgo, pad: PadStyle = "ceil",
                  pad_color: Sequence[int] = (0, 0, 0)) -> np.ndarray:
    """img_tool::resize: "none" stretches to width x height; "ceil" and "nearest" shrink or grow
    to fit inside, keeping the aspect ratio (the fitted size rounded up, or to nearest), and centre
    the result on pad_color."""
    pixels = _check_rgb(pixels)
    in_h, in_w = pixels.shape[:2]
    if (in_w, in_h) == (width, height):
        return pixels.copy()
    if pad == "none":
        return resize(pixels, width=width, height=height, algo=algo)
    if pad not in ("ceil", "nearest"):
        raise ValueError(f"unknown pad style {pad!r} (expected 'none', 'ceil' or 'nearest')")
    f32 = np.float32
    scale = min(f32(width) / f32(in_w), f32(height) / f32(in_h))  # float, as the C++ has it
    fit = _round_half_away if pad == "nearest" else (lambda v: int(np.ceil(v)))
    new_w = min(fit(f32(in_w) * scale), width)
    new_h = min(fit(f32(in_h) * scale), height)
    fitted = resize(pixels, width=new_w, height=new_h, algo=algo)
    if pad == "nearest":
        off_x = _round_half_away(f32(width - new_w) / f32(2.0))
        off_y = _round_half_away(f32(height - new_h) / f32(2.0))
    else:
        off_x, off_y = (width - new_w) // 2, (height - new_h) // 2
    out = np.empty((height, width, 3), np.uint8)
    out[:] = np.asarray(pad_color, dtype=np.uint8)
    out[off_y:off_y + new_h, off_x:off_x + new_w] = fitted
    return out


def smart_resize(width: int, height: int, *, align_size: int, min_pixels: int = 0, max_pixels: int = 0,
                 longest_edge: int = 0) -> tuple[int, int]:
    """img_tool::calc_size_preserved_ratio ("smart_resize" in transformers): the size, both sides
    multiples of align_size, nearest the image's (or with its longest edge at longest_edge, rounded
    up), then scaled down under max_pixels or up over min_pixels (0 disables each). Float32
    arithmetic and C rounding, as clip.cpp computes it. Returns (width, height)."""
    if align_size <= 0:
        raise ValueError(f"align_size must be positive, got {align_size}")
    if width <= 0 or height <= 0:
        return 0, 0
    f32, f = np.float32, np.float32(align_size)
    round_by = lambda v: _round_half_away(f32(v) / f) * align_size
    ceil_by = lambda v: int(np.ceil(f32(v) / f)) * align_size
    floor_by = lambda v: int(np.floor(f32(v) / f)) * align_size
    if longest_edge > 0:
        scale = min(f32(longest_edge) / f32(width), f32(longest_edge) / f32(height))
        w_bar, h_bar = ceil_by(f32(width) * scale), ceil_by(f32(height) * scale)
    else:
        w_bar, h_bar = max(align_size, round_by(width)), max(align_size, round_by(height))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels))
        h_bar = max(align_size, floor_by(f32(height) / beta))
        w_bar = max(align_size, floor_by(f32(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)))
        h_bar, w_bar = ceil_by(f32(height) * beta), ceil_by(f32(width) * beta)
    return w_bar, h_bar


def token_limits(n_tokens_min: int, n_tokens_max: int, *, patch_size: int, n_merge: int) -> tuple[int, int]:
    """clip_hparams::set_limit_image_tokens: (min_pixels, max_pixels) from output-token counts.
    clip.cpp's defaults: Qwen2/2.5/3-VL (8, 4096), Pixtral (8, 1024), Gemma 4 (70, 1120), LFM2 (64, 256)."""
    area = (patch_size * n_merge) ** 2
    return n_tokens_min * area, n_tokens_max * area


def normalize(pixels: np.ndarray, *, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(H, W, 3) uint8 -> (3, H, W) float32: (x / 255 - mean) / std per channel, every step in
    float32 as clip_image_f32 does it; channel-first, the layout of clip.cpp's inp_raw."""
    pixels = _check_rgb(pixels)
    m = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)
    x = pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)
    return (x - m) / s


# ---- the preprocessor families (mtmd_image_preprocessor_*) ----

@dataclass(frozen=True, eq=False)
class Preprocessed:
    """One image made ready for a tower (mtmd_image_preproc_out)."""
    slices: tuple[np.ndarray, ...]   # (3, H, W) float32 each: the one image, or the tiles row by row
    overview: np.ndarray | None      # the whole image downscaled, beside the tiles (idefics3, lfm2); else None
    grid_x: int                      # tiles per row (0: not tiled)
    grid_y: int                      # tile rows (0: not tiled)
    patch_size: int                  # the tower's patch side, in pixels

    def patches(self, arr: np.ndarray) -> tuple[int, int]:
        """(n_x, n_y): patches across and down one of these arrays, before any merge."""
        return arr.shape[2] // self.patch_size, arr.shape[1] // self.patch_size

    @property
    def slice_patches(self) -> tuple[tuple[int, int], ...]:
        return tuple(self.patches(a) for a in self.slices)


def _crop_tiles(pixels: np.ndarray, tile: int, grid_x: int, grid_y: int) -> list[np.ndarray]:
    return [pixels[y * tile:(y + 1) * tile, x * tile:(x + 1) * tile] for y in range(grid_y) for x in range(grid_x)]


def preprocess_fixed(img, *, size: int, patch_size: int, mean: Sequence[float], std: Sequence[float],
                     algo: ResizeAlgo = "bicubic", pad: PadStyle = "ceil", pad_color: Sequence[int] = (0, 0, 0)) -> Preprocessed:
    """mtmd_image_preprocessor_fixed_size: one size x size image. Gemma 3 (image_size 896, patch
    14): algo "bilinear" and clip.cpp's default pad "ceil", so a non-square image is fitted inside
    and letterboxed in black (transformers' Gemma3ImageProcessor stretches it instead)."""
    resized = resize_padded(img, width=size, height=size, algo=algo, pad=pad, pad_color=pad_color)
    return Preprocessed((normalize(resized, mean=mean, std=std),), None, 0, 0, patch_size)


def preprocess_dynamic(img, *, patch_size: int, n_merge: int, min_pixels: int, max_pixels: int,
                       mean: Sequence[float], std: Sequence[float], algo: ResizeAlgo = "bicubic",
                       pad: PadStyle = "ceil", pad_color: Sequence[int] = (0, 0, 0)) -> Preprocessed:
    """mtmd_image_preprocessor_dyn_size: the image at its own aspect ratio, both sides multiples of
    patch_size * n_merge, between min_pixels and max_pixels (see `token_limits`). Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL and Qwen3.5 (merge 2), Pixtral (merge 1, or its spatial_merge_size) and
    Gemma 4 (merge 3): all "bicubic", pad "ceil" (clip.cpp's default)."""
    pixels = _check_rgb(img)
    w, h = smart_resize(pixels.shape[1], pixels.shape[0], align_size=patch_size * n_merge,
                        min_pixels=min_pixels, max_pixels=max_pixels)
    resized = resize_padded(pixels, width=w, height=h, algo=algo, pad=pad, pad_color=pad_color)
    return Preprocessed((normalize(resized, mean=mean, std=std),), None, 0, 0, patch_size)


def preprocess_idefics3(img, *, image_size: int, patch_size: int, longest_edge: int, mean: Sequence[float],
                        std: Sequence[float], min_pixels: int = 0, max_pixels: int = 0,
                        algo: ResizeAlgo = "lanczos") -> Preprocessed:
    """mtmd_image_preprocessor_idefics3 (SmolVLM): image_size x image_size tiles plus an overview.
    With longest_edge (the GGUF's preproc_image_size) and no pixel limits: the longest side goes
    to longest_edge (the other even), then both up to multiples of image_size; all with `algo`
    (clip.cpp: Lanczos). Otherwise (an old GGUF, or token limits given): smart_resize to multiples
    of image_size; the refined image "bicubic", letterboxed; the overview "bicubic", stretched."""
    pixels = _check_rgb(img)
    in_h, in_w = pixels.shape[:2]
    if longest_edge > 0 and min_pixels <= 0 and max_pixels <= 0:
        aspect = in_w / in_h
        if in_w >= in_h:
            rw, rh = longest_edge, int(longest_edge / aspect)
            rh += rh % 2
        else:
            rw, rh = int(longest_edge * aspect), longest_edge
            rw += rw % 2
        grid_x, grid_y = -(-rw // image_size), -(-rh // image_size)
        resized = resize(pixels, width=rw, height=rh, algo=algo)
        refined = resize(resized, width=grid_x * image_size, height=grid_y * image_size, algo=algo)
        overview = resize(refined, width=image_size, height=image_size, algo=algo)
    else:
        rw, rh = smart_resize(in_w, in_h, align_size=image_size, min_pixels=max(0, min_pixels),
                              max_pixels=max(0, max_pixels), longest_edge=longest_edge)
        grid_x = int(np.ceil(np.float32(rw) / np.float32(image_size)))
        grid_y = int(np.ceil(np.float32(rh) / np.float32(image_size)))
        # slice_image with clip.cpp's defaults for the overview (stretch) and the refined image (pad)
        overview = resize_padded(pixels, width=image_size, height=image_size, algo="bicubic", pad="none")
        refined = resize_padded(pixels, width=rw, height=rh, algo="bicubic", pad="ceil")
    tiles = _crop_tiles(refined, image_size, grid_x, grid_y)
    return Preprocessed(tuple(normalize(t, mean=mean, std=std) for t in tiles),
                        normalize(overview, mean=mean, std=std), grid_x, grid_y, patch_size)


# LFM2-VL's processor constants, fixed in clip.cpp (mtmd_image_preprocessor_lfm2)
LFM2_TILE = 512
LFM2_MIN_TILES, LFM2_MAX_TILES = 2, 10
LFM2_MAX_PIXELS_TOLERANCE = 2.0
# get_target_ratios: every (w, h) with 2 <= w*h <= 10, in the order libstdc++'s std::sort (not
# stable) leaves them by area; the order breaks exact ties in find_closest_aspect_ratio
LFM2_RATIOS = ((2, 1), (1, 2), (1, 3), (3, 1), (2, 2), (4, 1), (1, 4), (1, 5), (5, 1), (3, 2),
               (2, 3), (1, 6), (6, 1), (1, 7), (7, 1), (2, 4), (4, 2), (1, 8), (8, 1), (3, 3),
               (1, 9), (9, 1), (10, 1), (1, 10), (5, 2), (2, 5))


def lfm2_should_tile(width: int, height: int, *, patch_size: int, n_merge: int, max_pixels: int) -> bool:
    """mtmd_image_preprocessor_lfm2::should_tile: the image rounded to the merge grid (nearbyint:
    halves to even) holds more than twice max_pixels."""
    align = patch_size * n_merge
    h_bar = max(patch_size, round(float(np.float32(height)) / align) * align)
    w_bar = max(patch_size, round(float(np.float32(width)) / align) * align)
    return float(h_bar) * float(w_bar) > float(max_pixels) * LFM2_MAX_PIXELS_TOLERANCE


def lfm2_grid(width: int, height: int) -> tuple[int, int]:
    """find_closest_aspect_ratio: the (tiles across, tiles down) whose ratio is nearest the image's;
    on an exact tie the later one wins if the image covers half its area. Float32, as in C++."""
    f32 = np.float32
    aspect = f32(width) / f32(height)
    area = f32(width * height)
    best, best_diff = (1, 1), f32(np.finfo(np.float32).max)
    for w, h in LFM2_RATIOS:
        diff = abs(aspect - f32(w) / f32(h))
        if diff < best_diff:
            best, best_diff = (w, h), diff
        elif diff == best_diff and area > f32(0.5) * f32(LFM2_TILE * LFM2_TILE * w * h):
            best = (w, h)
    return best


def preprocess_lfm2(img, *, patch_size: int, n_merge: int, min_pixels: int, max_pixels: int,
                    mean: Sequence[float], std: Sequence[float], algo: ResizeAlgo = "bilinear") -> Preprocessed:
    """mtmd_image_preprocessor_lfm2 (LFM2-VL): a small image is one smart-resized image (no
    overview); a large one (should_tile) becomes 512 x 512 tiles of the image letterboxed onto
    grid * 512, plus the smart-resized image as the overview (the thumbnail). clip.cpp: bilinear,
    limits token_limits(64, 256)."""
    pixels = _check_rgb(img)
    in_h, in_w = pixels.shape[:2]
    ow, oh = smart_resize(in_w, in_h, align_size=patch_size * n_merge, min_pixels=min_pixels, max_pixels=max_pixels)
    overview = normalize(resize_padded(pixels, width=ow, height=oh, algo=algo, pad="none"), mean=mean, std=std)
    if not lfm2_should_tile(in_w, in_h, patch_size=patch_size, n_merge=n_merge, max_pixels=max_pixels):
        return Preprocessed((overview,), None, 0, 0, patch_size)
    gx, gy = lfm2_grid(in_w, in_h)
    refined = resize_padded(pixels, width=gx * LFM2_TILE, height=gy * LFM2_TILE, algo=algo, pad="ceil")
    tiles = _crop_tiles(refined, LFM2_TILE, gx, gy)
    return Preprocessed(tuple(normalize(t, mean=mean, std=std) for t in tiles), overview, gx, gy, patch_size)
