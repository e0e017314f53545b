"""model_zoo/vision/preprocess.py against Pillow (the resampler, byte for byte), against sizes worked
by hand from llama.cpp's mtmd-image.cpp, and, where llama.cpp's libmtmd.so is at hand, against
llama.cpp's own compiled preprocessing, called with ctypes."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.vision import preprocess as pp
from hearthlm.model_zoo.vision.image import load_image

RNG = np.random.default_rng(11)
PIL_ALGO = {"bilinear": PILImage.Resampling.BILINEAR, "bicubic": PILImage.Resampling.BICUBIC,
            "lanczos": PILImage.Resampling.LANCZOS}
HALF = (0.5, 0.5, 0.5)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
LIBMTMD = Path(os.environ.get("HEARTHLM_LIBMTMD", "/tmp/lcp-venv/lib/python3.11/site-packages/llama_cpp/lib/libmtmd.so"))


def _pixels(w: int, h: int, block: int = 1) -> np.ndarray:
    """Noise, or blocks of noise (edges and flat runs: both sides of every clamp get exercised)."""
    a = RNG.integers(0, 256, (-(-h // block), -(-w // block), 3), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(np.repeat(a, block, 0), block, 1)[:h, :w])


def _pillow_width_first(a: np.ndarray, w: int, h: int, algo: str) -> np.ndarray:
    """Pillow's resize one axis at a time, width first (as clip.cpp runs its passes; Pillow 13
    resizing both at once sometimes runs the height first, which rounds differently)."""
    im = PILImage.fromarray(a)
    if w != a.shape[1]:
        im = im.resize((w, a.shape[0]), PIL_ALGO[algo])
    if h != a.shape[0]:
        im = im.resize((w, h), PIL_ALGO[algo])
    return np.asarray(im)


# ---- the resampler ----

SIZES = [((40, 30), (17, 13)), ((17, 13), (40, 30)), ((31, 29), (31, 7)), ((31, 29), (5, 29)),
         ((1, 1), (5, 3)), ((3, 200), (9, 11)), ((300, 2), (7, 50)), ((640, 480), (224, 224)),
         ((97, 61), (96, 62)), ((256, 256), (255, 257)), ((1000, 7), (333, 3)), ((2, 2), (1, 1))]


@pytest.mark.parametrize("algo", ["bilinear", "bicubic", "lanczos"])
def test_resize_equals_pillow_byte_for_byte(algo):
    """resize() equals Pillow's resampler (width pass, then height pass) on shrinking, growing,
    odd sizes, one axis only, 1x1, and aspect ratios up to 150:1. Mutation: the fixed-point
    weights truncated without Pillow's +/-0.5, the filter centre without its half-pixel offset,
    or Lanczos' sinc without the x/3 window, each fails it."""
    for (iw, ih), (ow, oh) in SIZES:
        for block in (1, 4):
            a = _pixels(iw, ih, block)
            got = pp.resize(a, width=ow, height=oh, algo=algo)
            assert got.shape == (oh, ow, 3) and got.dtype == np.uint8
            np.testing.assert_array_equal(got, _pillow_width_first(a, ow, oh, algo), err_msg=f"{(iw, ih)} -> {(ow, oh)}")


def test_resize_random_sizes_equal_pillow():
    """60 random size pairs (1 to 160 a side) per algorithm: equal to Pillow. Mutation: the
    height pass run before the width pass fails it."""
    for algo in PIL_ALGO:
        for _ in range(60):
            iw, ih, ow, oh = (int(v) for v in RNG.integers(1, 160, 4))
            a = _pixels(iw, ih, int(RNG.integers(1, 4)))
            np.testing.assert_array_equal(pp.resize(a, width=ow, height=oh, algo=algo), _pillow_width_first(a, ow, oh, algo))


def test_resize_same_size_copies_and_bad_targets_refused():
    """Resizing to the same size returns an equal copy; a target of 0 or over 65536 a side is
    refused (clip.cpp throws). Mutation: returning the input itself fails the copy check."""
    a = _pixels(5, 4)
    b = pp.resize(a, width=5, height=4, algo="bicubic")
    assert b is not a and np.array_equal(a, b)
    with pytest.raises(InvalidRequestError, match="out of range"):
        pp.resize(a, width=0, height=4, algo="bilinear")
    with pytest.raises(InvalidRequestError, match="out of range"):
        pp.resize(a, width=65537, height=4, algo="bilinear")
    with pytest.raises(ValueError, match="unknown resize algorithm"):
        pp.resize(a, width=3, height=3, algo="nearest")


def test_pad_styles_worked_by_hand():
    """img_tool::resize's pads, 300x200 into 101x101: scale 101/300; "ceil" fits 101x68
    (ceil 67.33) at row 16 ((101-68)//2); "nearest" fits 101x67 at row 17 (round(34/2.0));
    "none" stretches. The fitted part is Pillow's resize, the rest the pad colour. Mutation:
    the ceil offset rounded like nearest, or nearest's size ceiled, fails it."""
    a = _pixels(300, 200, 3)
    color = (7, 8, 9)
    for pad, (fit_h, top) in {"ceil": (68, 16), "nearest": (67, 17)}.items():
        out = pp.resize_padded(a, width=101, height=101, algo="bicubic", pad=pad, pad_color=color)
        assert out.shape == (101, 101, 3)
        np.testing.assert_array_equal(out[top:top + fit_h], _pillow_width_first(a, 101, fit_h, "bicubic"))
        assert (out[:top] == color).all() and (out[top + fit_h:] == color).all()
    stretched = pp.resize_padded(a, width=101, height=101, algo="bicubic", pad="none")
    np.testing.assert_array_equal(stretched, _pillow_width_first(a, 101, 101, "bicubic"))


# ---- sizes: smart resize, tiling grids ----

def test_smart_resize_worked_by_hand():
    """img_tool::calc_size_preserved_ratio, worked by hand:
    - Qwen3-VL (align 32, token_limits(8, 4096) = 8192..4194304 px): 640x480 stays; 4000x3000
      (4000x3008 rounded, over the max) gets beta = sqrt(12e6/4194304) = 1.69145, floor to
      2336x1760; 20x10 goes up to 32x32, under the min, so beta = sqrt(8192/200) = 6.4, ceil to
      128x64.
    - Pixtral (align 16, 2048..262144): 1024x768, beta = sqrt(3), floors to 576x432.
    - Gemma 4 (align 48, token_limits(70, 1120)): 640x480 rounds to 624x480.
    - std::round takes halves away from zero: 80/32 = 2.5 -> 96 (numpy's round gives 64).
    - longest_edge 1536, align 512: 1500x1100 gives 2048x1536, not 1536x1536: in float32,
      1536/1500 = 1.02400005, so 1500 * scale = 1536.0001 and its ceil takes a 4th tile
      (llama.cpp's SmolVLM path with token limits does the same: checked with libmtmd.so).
    Mutation: np.round for std::round fails the 80 case; float64 arithmetic fails the
    1500x1100 case."""
    qmin, qmax = pp.token_limits(8, 4096, patch_size=16, n_merge=2)
    assert (qmin, qmax) == (8192, 4194304)
    assert pp.smart_resize(640, 480, align_size=32, min_pixels=qmin, max_pixels=qmax) == (640, 480)
    assert pp.smart_resize(4000, 3000, align_size=32, min_pixels=qmin, max_pixels=qmax) == (2336, 1760)
    assert pp.smart_resize(20, 10, align_size=32, min_pixels=qmin, max_pixels=qmax) == (128, 64)
    assert pp.smart_resize(1024, 768, align_size=16, min_pixels=2048, max_pixels=262144) == (576, 432)
    gmin, gmax = pp.token_limits(70, 1120, patch_size=16, n_merge=3)
    assert pp.smart_resize(640, 480, align_size=48, min_pixels=gmin, max_pixels=gmax) == (624, 480)
    assert pp.smart_resize(80, 80, align_size=32) == (96, 96)
    assert pp.smart_resize(1500, 1100, align_size=512, longest_edge=1536) == (2048, 1536)


def test_lfm2_grid_and_should_tile_worked_by_hand():
    """mtmd_image_preprocessor_lfm2: 2100x700 (ratio 3) -> 3x1; 1500x1100 (1.36) -> 3x2 (1.5
    is nearest; 4:3 needs 12 tiles, over 10); a square ties 2x2 with 3x3, and the later (3x3)
    wins only when the image covers half its area (0.5 * 9 * 512^2 = 1179648): 1000^2 -> 2x2,
    1100^2 -> 3x3. should_tile rounds with nearbyint (halves to even): 1040x512 rounds to
    1024x512 = 2 * 262144, not over, so no tiles (C's round would give 1056 and tile).
    Mutation: dropping the tie rule, or std::round in should_tile, fails it."""
    assert pp.lfm2_grid(2100, 700) == (3, 1)
    assert pp.lfm2_grid(1500, 1100) == (3, 2)
    assert pp.lfm2_grid(1000, 1000) == (2, 2)
    assert pp.lfm2_grid(1100, 1100) == (3, 3)
    kw = dict(patch_size=16, n_merge=2, max_pixels=262144)
    assert not pp.lfm2_should_tile(1040, 512, **kw)
    assert pp.lfm2_should_tile(1072, 512, **kw)
    assert not pp.lfm2_should_tile(1024, 512, **kw)


def test_lfm2_tiles_and_overview():
    """A 1500x1100 image for LFM2-VL: 6 tiles of 512x512 in row order, cut from the image
    letterboxed (bilinear, "ceil") onto 1536x1024, plus the overview: smart_resize to 576x416,
    stretched. A small 300x200 image is one image, no overview, no grid: 288x192 rounded is under
    the 65536 px minimum, so beta = sqrt(65536/60000) grows it to 320x224. Mutation:
    tiles taken column by column fails it."""
    mn, mx = pp.token_limits(64, 256, patch_size=16, n_merge=2)
    a = _pixels(1500, 1100, 8)
    out = pp.preprocess_lfm2(a, patch_size=16, n_merge=2, min_pixels=mn, max_pixels=mx, mean=HALF, std=HALF)
    assert (out.grid_x, out.grid_y) == (3, 2) and len(out.slices) == 6
    refined = pp.resize_padded(a, width=1536, height=1024, algo="bilinear", pad="ceil")
    for i, s in enumerate(out.slices):
        y, x = divmod(i, 3)
        np.testing.assert_array_equal(s, pp.normalize(refined[y * 512:(y + 1) * 512, x * 512:(x + 1) * 512], mean=HALF, std=HALF))
    assert out.overview.shape == (3, 416, 576) and out.slice_patches == ((32, 32),) * 6
    np.testing.assert_array_equal(out.overview, pp.normalize(pp.resize(a, width=576, height=416, algo="bilinear"), mean=HALF, std=HALF))
    small = pp.preprocess_lfm2(_pixels(300, 200), patch_size=16, n_merge=2, min_pixels=mn, max_pixels=mx, mean=HALF, std=HALF)
    assert small.overview is None and (small.grid_x, small.grid_y) == (0, 0) and small.slices[0].shape == (3, 224, 320)


def test_idefics3_tiles_worked_by_hand():
    """SmolVLM (tile 512, longest_edge 1536, Lanczos): 1500x1100 -> 1536x1126 (1536/1.3636,
    even) -> 3x3 tiles of the image grown to 1536x1536, overview 512x512 of that.
    77x400 -> 296x1536 (295 made even) -> 1x3. Without longest_edge (an old GGUF): smart_resize to
    multiples of 512 -> 1536x1024, 3x2 tiles. Mutation: tiles cut from the first resize
    (1536x1126, padded) instead of the refined 1536x1536 fail it."""
    a = _pixels(1500, 1100, 16)
    out = pp.preprocess_idefics3(a, image_size=512, patch_size=16, longest_edge=1536, mean=HALF, std=HALF)
    assert (out.grid_x, out.grid_y, len(out.slices)) == (3, 3, 9)
    refined = pp.resize(pp.resize(a, width=1536, height=1126, algo="lanczos"), width=1536, height=1536, algo="lanczos")
    np.testing.assert_array_equal(out.slices[5], pp.normalize(refined[512:1024, 1024:1536], mean=HALF, std=HALF))
    overview = pp.resize(refined, width=512, height=512, algo="lanczos")
    np.testing.assert_array_equal(out.overview, pp.normalize(overview, mean=HALF, std=HALF))
    tall = pp.preprocess_idefics3(_pixels(77, 400, 4), image_size=512, patch_size=16, longest_edge=1536, mean=HALF, std=HALF)
    assert (tall.grid_x, tall.grid_y) == (1, 3)
    old = pp.preprocess_idefics3(a, image_size=512, patch_size=16, longest_edge=0, mean=HALF, std=HALF)
    assert (old.grid_x, old.grid_y, len(old.slices)) == (3, 2, 6) and old.overview.shape == (3, 512, 512)


# ---- fixed and dynamic sizes, normalization ----

def test_gemma3_letterboxes_a_wide_image():
    """Gemma 3 (896, bilinear, clip.cpp's default pad "ceil"): a 200x100 red image becomes
    896x448 of red between two 224-row black bands; normalized with mean = std = 0.5, red is
    (1, -1, -1) and black -1. A 50x100 one is 448 columns wide (224 to 671): in float32,
    50 * (896/100) = 448.000002 rounds to 448.0 (float64 would ceil 448.00000000000006 to 449,
    from column 223). Mutation: pad "none" as the default, or resize_padded in float64, fails it."""
    a = np.zeros((100, 200, 3), np.uint8)
    a[:, :, 0] = 255
    out = pp.preprocess_fixed(a, size=896, patch_size=14, mean=HALF, std=HALF, algo="bilinear")
    (x,) = out.slices
    assert x.shape == (3, 896, 896) and out.slice_patches == ((64, 64),)
    assert (x[:, :224] == -1).all() and (x[:, 672:] == -1).all()
    assert (x[0, 224:672] == 1).all() and (x[1:, 224:672] == -1).all()
    (tall,) = pp.preprocess_fixed(a[:, :50], size=896, patch_size=14, mean=HALF, std=HALF, algo="bilinear").slices
    assert (tall[0, :, 224:672] == 1).all() and (tall[0, :, :224] == -1).all() and (tall[0, :, 672:] == -1).all()


def test_dynamic_size_is_the_smart_resize():
    """Qwen3-VL on 640x481: smart_resize gives 640x480; the image is fitted with "ceil" (to
    639x480, scale 480/481), one column of black on the right... of which (1 // 2) = 0 on the
    left, so column 639 is the pad. Patches 40x30. Mutation: pad "none" (a stretch) fails it."""
    mn, mx = pp.token_limits(8, 4096, patch_size=16, n_merge=2)
    a = _pixels(640, 481, 2)
    out = pp.preprocess_dynamic(a, patch_size=16, n_merge=2, min_pixels=mn, max_pixels=mx, mean=CLIP_MEAN, std=CLIP_STD)
    (x,) = out.slices
    assert x.shape == (3, 480, 640) and out.slice_patches == ((40, 30),)
    fitted = _pillow_width_first(a, 639, 480, "bicubic")
    np.testing.assert_array_equal(x[:, :, :639], pp.normalize(fitted, mean=CLIP_MEAN, std=CLIP_STD))
    black = (np.float32(0) - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    np.testing.assert_array_equal(x[:, :, 639], np.broadcast_to(black[:, None], (3, 480)))


def test_normalize_values_and_layout():
    """(x / 255 - mean) / std with every step in float32 (clip_image_f32), laid out (3, H, W) with
    R first, over all 256 levels in each channel; an Image is accepted too. The float64 formula
    rounds differently on some levels, so the check can tell. Mutation: dividing by 256,
    channel-last output, or float64 arithmetic fails it."""
    a = np.stack([np.arange(256, dtype=np.uint8), np.arange(255, -1, -1).astype(np.uint8), np.arange(256, dtype=np.uint8)], axis=1)[None]
    out = pp.normalize(load_image(a), mean=CLIP_MEAN, std=CLIP_STD)
    assert out.shape == (3, 1, 256) and out.dtype == np.float32
    f = np.float32
    want = np.array([[(f(v) / f(255) - f(CLIP_MEAN[c])) / f(CLIP_STD[c]) for v in a[0, :, c]] for c in range(3)], np.float32)
    np.testing.assert_array_equal(out[:, 0], want)
    wide = np.array([[(v / 255 - f(CLIP_MEAN[c]).item()) / f(CLIP_STD[c]).item() for v in a[0, :, c].tolist()] for c in range(3)])
    assert (wide.astype(np.float32) != want).any()


def test_bad_pixels_refused():
    """Preprocessing takes (H, W, 3) uint8 (or an Image) only. Mutation: no check lets a float
    array through to a confusing numpy error."""
    with pytest.raises(TypeError, match=r"expected \(H, W, 3\) uint8"):
        pp.preprocess_fixed(np.zeros((4, 4, 3), np.float32), size=8, patch_size=4, mean=HALF, std=HALF)


# ---- llama.cpp itself: libmtmd.so through ctypes ----
# The layouts below are the vendored headers' (clip-impl.h, clip-model.h, mtmd-image.h) as g++ 12
# lays them out, checked once with offsetof: clip_image_u8 {std::vector<uint8_t> buf; int nx, ny}
# = 32 bytes; clip_image_f32 = 56 (buf at 24, nx at 48, ny at 52); mtmd_image_preproc_out = 88
# (entries at 0, overview at 24, grid_x at 80, grid_y at 84); clip_hparams = 656 (offsets in _HP).

_HP = {"image_size": 0, "patch_size": 4, "n_merge": 36, "longest_edge": 40, "min_pixels": 44, "max_pixels": 48,
       "algo": 52, "pad": 56, "pad_color": 60, "algo_rf": 100, "algo_ov": 104, "pad_rf": 108, "pad_ov": 112,
       "mean": 124, "std": 136}
_ALGO = {"bilinear": 0, "bicubic": 1, "lanczos": 2}
_PAD = {"none": 0, "ceil": 1, "nearest": 2}
_CLASSES = {"fixed": "34mtmd_image_preprocessor_fixed_size", "dyn": "32mtmd_image_preprocessor_dyn_size",
            "idefics3": "32mtmd_image_preprocessor_idefics3", "lfm2": "28mtmd_image_preprocessor_lfm2"}


class _U8(ctypes.Structure):
    _fields_ = [("begin", ctypes.c_void_p), ("end", ctypes.c_void_p), ("cap", ctypes.c_void_p),
                ("nx", ctypes.c_int), ("ny", ctypes.c_int)]


class _Mtmd:
    """Calls into llama.cpp's compiled preprocessing. The objects C++ hands back are leaked (a
    few MB in a test run): freeing them needs destructors the library does not export."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self._quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
        self.lib.mtmd_log_set(self._quiet, None)
        self.resize = self.lib["_ZN8img_tool6resizeERK13clip_image_u8RS0_RK15clip_image_size11resize_algo9pad_styleSt5arrayIhLm3EE"]
        self.resize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_uint32]
        self.resize.restype = None

    @staticmethod
    def image(a: np.ndarray | None, w: int = 0, h: int = 0) -> _U8:
        """A clip_image_u8 over a's bytes, or a placeholder (no pixels: sizes only) of w x h."""
        if a is None:
            return _U8(None, None, None, w, h)
        p = a.ctypes.data
        u = _U8(p, p + a.nbytes, p + a.nbytes, a.shape[1], a.shape[0])
        u._keep = a
        return u

    def img_resize(self, a: np.ndarray, w: int, h: int, algo: str, pad: str, color=(0, 0, 0)) -> np.ndarray:
        dst, size = _U8(), (ctypes.c_int * 2)(w, h)
        self.resize(ctypes.byref(self.image(a)), ctypes.byref(dst), size, _ALGO[algo], _PAD[pad],
                    color[0] | color[1] << 8 | color[2] << 16)
        return np.ctypeslib.as_array((ctypes.c_uint8 * (w * h * 3)).from_address(dst.begin)).reshape(h, w, 3).copy()

    @staticmethod
    def hparams(**kv) -> ctypes.Array:
        hp = (ctypes.c_uint8 * 656)()
        base = ctypes.addressof(hp)
        kv = {"n_merge": 1, "longest_edge": 0, "min_pixels": -1, "max_pixels": -1, "algo": "bicubic", "pad": "ceil",
              "algo_rf": "bicubic", "algo_ov": "bicubic", "pad_rf": "ceil", "pad_ov": "none", **kv}
        for key, off in _HP.items():
            v = kv.get(key, (0, 0, 0) if key == "pad_color" else None)
            if key in ("mean", "std"):
                (ctypes.c_float * 3).from_address(base + off)[:] = v
            elif key == "pad_color":
                (ctypes.c_uint8 * 3).from_address(base + off)[:] = v
            else:
                ctypes.c_int32.from_address(base + off).value = _ALGO.get(v, _PAD.get(v, v)) if isinstance(v, str) else v
        return hp

    def preprocess(self, kind: str, hp, a: np.ndarray | None, w: int = 0, h: int = 0):
        """mtmd_image_preprocessor_<kind>::preprocess(img) on an object made by hand: {vtable, &hparams}.
        Returns (entries, overview, grid_x, grid_y); each image as (nx, ny, (3, H, W) floats or None)."""
        fn = self.lib[f"_ZNK{_CLASSES[kind]}10preprocessERK13clip_image_u8"]
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 3, None
        vtable = ctypes.addressof(ctypes.c_char.in_dll(self.lib, f"_ZTV{_CLASSES[kind]}")) + 16
        this = (ctypes.c_void_p * 2)(vtable, ctypes.addressof(hp))
        out = (ctypes.c_uint8 * 88)()
        fn(ctypes.addressof(out), this, ctypes.byref(self.image(a, w, h)))  # the result is returned through `out`
        base = ctypes.addressof(out)
        begin, end = ctypes.c_void_p.from_address(base).value, ctypes.c_void_p.from_address(base + 8).value
        entries = [self._f32(p) for p in range(begin, end, 56)] if begin else []
        grid = ctypes.c_int.from_address(base + 80).value, ctypes.c_int.from_address(base + 84).value
        return entries, self._f32(base + 24), *grid

    @staticmethod
    def _f32(addr: int):
        nx, ny = ctypes.c_int.from_address(addr + 48).value, ctypes.c_int.from_address(addr + 52).value
        buf = ctypes.c_void_p.from_address(addr + 24).value
        if not buf:
            return nx, ny, None
        a = np.ctypeslib.as_array((ctypes.c_float * (nx * ny * 3)).from_address(buf)).reshape(ny, nx, 3)
        return nx, ny, a.transpose(2, 0, 1).copy()

    def target_ratios(self) -> list[tuple[int, int]]:
        fn = self.lib["_ZNK28mtmd_image_preprocessor_lfm217get_target_ratiosEv"]
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 2, None
        out = (ctypes.c_void_p * 3)()
        fn(ctypes.addressof(out), None)
        pairs = np.ctypeslib.as_array((ctypes.c_int * ((out[1] - out[0]) // 4)).from_address(out[0])).reshape(-1, 2)
        return [tuple(int(v) for v in p) for p in pairs]


@pytest.fixture(scope="module")
def mtmd():
    if not LIBMTMD.exists():
        pytest.skip(f"llama.cpp's libmtmd.so not at {LIBMTMD} (set HEARTHLM_LIBMTMD)")
    init = LIBMTMD.parent.parent / "__init__.py"  # llama_cpp/lib/libmtmd.so -> llama_cpp/__init__.py
    if '__version__ = "0.3.36"' not in (init.read_text() if init.exists() else ""):
        pytest.skip("the struct layouts here are llama-cpp-python 0.3.36's; another build could crash, not fail")
    return _Mtmd(LIBMTMD)


def _same(ours: pp.Preprocessed, theirs) -> None:
    entries, overview, gx, gy = theirs
    assert (ours.grid_x, ours.grid_y) == (gx, gy)
    assert len(ours.slices) == len(entries)
    for mine, (nx, ny, arr) in zip(ours.slices, entries):
        assert mine.shape == (3, ny, nx)
        np.testing.assert_array_equal(mine, arr)
    if ours.overview is None:
        assert overview[:2] == (0, 0)
    else:
        np.testing.assert_array_equal(ours.overview, overview[2])


def test_resize_equals_llama_cpp(mtmd):
    """img_tool::resize from libmtmd.so and resize_padded agree byte for byte, every algorithm
    and pad style, on 40 random size pairs and two where float32 matters (50x100 into 896x896:
    50 * 8.96f rounds to 448.0, where float64's 448.00000000000006 would ceil to 449). Mutation:
    resize_padded's scale computed in float64 fails it."""
    pairs = [(50, 100, 896, 896), (25, 100, 224, 224)] + [tuple(int(v) for v in RNG.integers(2, 120, 4)) for _ in range(40)]
    for iw, ih, ow, oh in pairs:
        a = _pixels(iw, ih, 2)
        for algo in _ALGO:
            for pad in _PAD:
                try:
                    got = pp.resize_padded(a, width=ow, height=oh, algo=algo, pad=pad, pad_color=(3, 4, 5))
                except InvalidRequestError:  # "nearest" fitted a side to 0: llama.cpp throws (and would abort here)
                    assert pad == "nearest"
                    continue
                np.testing.assert_array_equal(got, mtmd.img_resize(a, ow, oh, algo, pad, (3, 4, 5)), err_msg=f"{iw}x{ih} {algo} {pad}")


def test_preprocessors_equal_llama_cpp(mtmd):
    """Whole preprocessors, float for float, against libmtmd.so's: Gemma 3 (fixed 896, bilinear),
    Qwen3-VL and Gemma 4 (dyn_size), SmolVLM (idefics3, both paths) and LFM2-VL (one image, and
    tiles + overview), on a wide, a tall, a small and a large image. Mutation: normalizing with
    float64 arithmetic, the LFM2 refined image stretched instead of letterboxed, or SmolVLM's
    odd sides (645 for 50x21, 511 for 333x1000) not made even, each fails it."""
    qmin, qmax = pp.token_limits(8, 4096, patch_size=16, n_merge=2)
    gmin, gmax = pp.token_limits(70, 1120, patch_size=16, n_merge=3)
    lmin, lmax = pp.token_limits(64, 256, patch_size=16, n_merge=2)
    for w, h in [(640, 480), (333, 1000), (50, 21), (1500, 1100)]:
        a = _pixels(w, h, 4)
        hp = mtmd.hparams(image_size=896, patch_size=14, algo="bilinear", mean=HALF, std=HALF)
        _same(pp.preprocess_fixed(a, size=896, patch_size=14, mean=HALF, std=HALF, algo="bilinear"), mtmd.preprocess("fixed", hp, a))
        for merge, lo, hi in [(2, qmin, qmax), (3, gmin, gmax)]:
            hp = mtmd.hparams(image_size=768, patch_size=16, n_merge=merge, min_pixels=lo, max_pixels=hi, mean=CLIP_MEAN, std=CLIP_STD)
            _same(pp.preprocess_dynamic(a, patch_size=16, n_merge=merge, min_pixels=lo, max_pixels=hi, mean=CLIP_MEAN, std=CLIP_STD),
                  mtmd.preprocess("dyn", hp, a))
        for edge in (1536, 0):
            hp = mtmd.hparams(image_size=512, patch_size=16, n_merge=4, longest_edge=edge, algo="lanczos", mean=HALF, std=HALF)
            _same(pp.preprocess_idefics3(a, image_size=512, patch_size=16, longest_edge=edge, mean=HALF, std=HALF),
                  mtmd.preprocess("idefics3", hp, a))
        hp = mtmd.hparams(image_size=512, patch_size=16, n_merge=2, min_pixels=lmin, max_pixels=lmax, algo="bilinear",
                          algo_rf="bilinear", algo_ov="bilinear", mean=HALF, std=HALF)
        _same(pp.preprocess_lfm2(a, patch_size=16, n_merge=2, min_pixels=lmin, max_pixels=lmax, mean=HALF, std=HALF),
              mtmd.preprocess("lfm2", hp, a))


def test_sizes_and_grids_equal_llama_cpp(mtmd):
    """Sizes only (llama.cpp's placeholder images: no pixels), over 400 random image sizes up to
    8000 a side: smart_resize for Qwen3-VL, Pixtral and Gemma 4 limits, LFM2's tiling decision,
    grid and overview, SmolVLM's grids, all equal llama.cpp's; and LFM2's ratio list is in
    libstdc++'s sort order. Mutation: smart_resize's max_pixels branch rounding up instead of
    down, or LFM2_RATIOS in Python's stable sort order, fails it. (Its float32 arithmetic
    shows on few sizes: test_smart_resize_worked_by_hand holds one.)"""
    assert mtmd.target_ratios() == list(pp.LFM2_RATIOS)
    limits = [(16, 2, *pp.token_limits(8, 4096, patch_size=16, n_merge=2)), (14, 2, *pp.token_limits(8, 4096, patch_size=14, n_merge=2)),
              (16, 1, *pp.token_limits(8, 1024, patch_size=16, n_merge=1)), (16, 3, *pp.token_limits(70, 1120, patch_size=16, n_merge=3))]
    lmin, lmax = pp.token_limits(64, 256, patch_size=16, n_merge=2)
    hp_lfm2 = mtmd.hparams(image_size=512, patch_size=16, n_merge=2, min_pixels=lmin, max_pixels=lmax, mean=HALF, std=HALF)
    hp_smol = mtmd.hparams(image_size=512, patch_size=16, n_merge=4, longest_edge=1536, mean=HALF, std=HALF)
    n_tiled = 0
    for _ in range(400):
        w, h = (int(v) for v in np.exp(RNG.uniform(np.log(8), np.log(8000), 2)))
        for patch, merge, lo, hi in limits:
            hp = mtmd.hparams(image_size=768, patch_size=patch, n_merge=merge, min_pixels=lo, max_pixels=hi, mean=HALF, std=HALF)
            (nx, ny, _), = mtmd.preprocess("dyn", hp, None, w, h)[0]
            assert pp.smart_resize(w, h, align_size=patch * merge, min_pixels=lo, max_pixels=hi) == (nx, ny), (w, h, patch, merge)
        entries, overview, gx, gy = mtmd.preprocess("lfm2", hp_lfm2, None, w, h)
        tiles = pp.lfm2_should_tile(w, h, patch_size=16, n_merge=2, max_pixels=lmax)
        n_tiled += tiles
        assert (pp.lfm2_grid(w, h) if tiles else (0, 0)) == (gx, gy), (w, h)
        ow, oh = pp.smart_resize(w, h, align_size=32, min_pixels=lmin, max_pixels=lmax)
        assert ((overview if tiles else entries[0])[:2]) == (ow, oh)
        if max(w, h) < 100 * min(w, h):  # llama.cpp asserts on a side rounding to 0
            _, _, gx, gy = mtmd.preprocess("idefics3", hp_smol, None, w, h)
            rw, rh = (1536, int(1536 / (w / h))) if w >= h else (int(1536 * (w / h)), 1536)
            assert (-(-(rw + rw % 2) // 512), -(-(rh + rh % 2) // 512)) == (gx, gy), (w, h)
    assert 20 < n_tiled < 380  # both LFM2 branches were compared
