"""model_zoo/vision/image.py: every input kind load_image takes, the pixels stb_image (llama.cpp's
loader) would give, the digest, and every refusal, each naming the image."""
from __future__ import annotations

import base64
import ctypes
import io
import os
import struct
import urllib.error
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageFile

from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.vision import image as image_mod
from hearthlm.model_zoo.vision.image import Image, ImageLimits, load_image

RNG = np.random.default_rng(7)
RGBA = RNG.integers(0, 256, (21, 34, 4), dtype=np.uint8)
RGBA[0, 0, 3] = 0  # a fully transparent pixel keeps its colour in stb
RGB = np.ascontiguousarray(RGBA[:, :, :3])
LIBMTMD = Path(os.environ.get("HEARTHLM_LIBMTMD", "/tmp/lcp-venv/lib/python3.11/site-packages/llama_cpp/lib/libmtmd.so"))


def _encode(im: PILImage.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _png(width: int, height: int, *, bit_depth: int = 8, color_type: int = 2, raw: bytes | None = None,
         idat: bytes | None = None) -> bytes:
    """A PNG written by hand: any header (a bomb's), any pixel data."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", idat if idat is not None else zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _bomb(side: int) -> bytes:
    """A valid 1-bit grey PNG of side x side zero pixels: a few KB that decode to side^2 pixels."""
    row = b"\x00" * (1 + (side + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    return _png(side, side, bit_depth=1, color_type=0, idat=idat)


PNG = _encode(PILImage.fromarray(RGB), "PNG")


def _refused(match: str, src, **kw) -> str:
    with pytest.raises(InvalidRequestError, match=match) as e:
        load_image(src, **kw)
    return str(e.value)


# ---- input kinds ----

def test_every_input_kind_gives_the_same_pixels(tmp_path):
    """Bytes, bytearray, memoryview, a str path, a Path, a data URL, a PIL image, an RGB and an
    RGBA array, and an Image all give RGB's pixels and one digest. Mutation: the RGBA array keeping
    channels 1..3 (arr[..., 1:]) fails it; so does a data URL decoded without base64."""
    path = tmp_path / "x.png"
    path.write_bytes(PNG)
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    sources = [PNG, bytearray(PNG), memoryview(PNG), str(path), path, url, PILImage.open(io.BytesIO(PNG)),
               RGB, RGBA, PILImage.fromarray(RGBA, "RGBA")]
    images = [load_image(s) for s in sources]
    for img in images:
        assert isinstance(img, Image) and img.pixels.shape == (21, 34, 3) and img.pixels.dtype == np.uint8
        np.testing.assert_array_equal(img.pixels, RGB)
        assert img.digest == images[0].digest and img == images[0]
    assert load_image(images[0]) is images[0]
    assert (images[0].width, images[0].height) == (34, 21)


def test_data_url_forms():
    """Whitespace inside the base64, upper-case 'DATA:', no media type, and a percent-encoded
    (not base64) payload all decode. Mutation: stripping no whitespace fails it."""
    b64 = base64.b64encode(PNG).decode()
    wrapped = "\n".join(b64[i:i + 60] for i in range(0, len(b64), 60))
    for url in ("data:image/png;base64," + wrapped, "DATA:image/png;base64," + b64, "data:;base64," + b64,
                "data:image/png," + "".join(f"%{c:02x}" for c in PNG)):
        np.testing.assert_array_equal(load_image(url).pixels, RGB)


def test_formats_jpeg_webp_gif_bmp():
    """WebP (lossless), GIF and BMP give the source pixels exactly; a GIF's first frame is taken,
    not a later one; JPEG gives Pillow's decode. Mutation: seeking the last GIF frame fails it."""
    yy, xx = np.mgrid[0:32, 0:48]
    smooth = np.stack([xx * 5, yy * 7, (xx + yy) * 3], axis=2).astype(np.uint8)
    np.testing.assert_array_equal(load_image(_encode(PILImage.fromarray(RGB), "WEBP", lossless=True)).pixels, RGB)
    np.testing.assert_array_equal(load_image(_encode(PILImage.fromarray(RGB), "BMP")).pixels, RGB)
    frames = [PILImage.fromarray(np.full((8, 9, 3), v, np.uint8)) for v in (10, 200)]
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert PILImage.open(io.BytesIO(gif)).n_frames == 2
    np.testing.assert_array_equal(load_image(gif).pixels, np.full((8, 9, 3), 10, np.uint8))
    jpeg = _encode(PILImage.fromarray(smooth), "JPEG", quality=95)
    got = load_image(jpeg).pixels
    np.testing.assert_array_equal(got, np.asarray(PILImage.open(io.BytesIO(jpeg)).convert("RGB")))
    assert np.abs(got.astype(int) - smooth).mean() < 3


def test_alpha_and_deep_samples_as_stb_gives_them():
    """As stb_image with 3 channels: alpha dropped, not blended (a transparent pixel keeps its
    colour); grey+alpha spread to grey; 16-bit samples cut to their high byte (grey and RGB);
    a GIF's transparent pixels black. Mutation: compositing RGBA on black, or 16-bit grey clipped
    at 255 (Pillow's own I;16 -> RGB), or the GIF rule dropped, each fails it."""
    assert load_image(_encode(PILImage.fromarray(RGBA, "RGBA"), "PNG")).pixels[0, 0].tolist() == RGBA[0, 0, :3].tolist()
    la = load_image(_encode(PILImage.fromarray(RGBA[:, :, :2], "LA"), "PNG")).pixels
    np.testing.assert_array_equal(la, np.repeat(RGBA[:, :, :1], 3, axis=2))
    grey16 = RNG.integers(0, 65536, (5, 6), dtype=np.uint16)
    got = load_image(_png(6, 5, bit_depth=16, color_type=0, raw=b"".join(b"\x00" + r.astype(">u2").tobytes() for r in grey16)))
    np.testing.assert_array_equal(got.pixels, np.repeat((grey16 >> 8).astype(np.uint8)[:, :, None], 3, axis=2))
    rgb16 = RNG.integers(0, 65536, (4, 3, 3), dtype=np.uint16)
    got = load_image(_png(3, 4, bit_depth=16, color_type=2, raw=b"".join(b"\x00" + r.astype(">u2").tobytes() for r in rgb16)))
    np.testing.assert_array_equal(got.pixels, (rgb16 >> 8).astype(np.uint8))
    idx = np.array([[0, 1], [2, 1]], np.uint8)
    pal = PILImage.fromarray(idx, "P")
    pal.putpalette([10, 20, 30, 40, 50, 60, 70, 80, 90] + [0] * 759)
    got = load_image(_encode(pal, "GIF", transparency=1)).pixels
    assert got.tolist() == [[[10, 20, 30], [0, 0, 0]], [[70, 80, 90], [0, 0, 0]]]


def _stb_load(lib, data: bytes) -> np.ndarray:
    x, y, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    p = lib.stbi_load_from_memory(data, len(data), ctypes.byref(x), ctypes.byref(y), ctypes.byref(c), 3)
    assert p, "stb_image could not decode the case"
    out = np.ctypeslib.as_array(p, shape=(y.value, x.value, 3)).copy()
    lib.stbi_image_free(p)
    return out


@pytest.mark.skipif(not LIBMTMD.exists(), reason=f"llama.cpp's libmtmd.so not at {LIBMTMD} (set HEARTHLM_LIBMTMD)")
def test_pixels_equal_llama_cpps_stb_image():
    """The pixels equal those of the stb_image inside llama.cpp's libmtmd.so (loaded with ctypes,
    stbi_load_from_memory with 3 channels) for PNG (RGB, RGBA, grey, grey+alpha, 1-bit, palette
    with and without tRNS, 16-bit grey and RGB), GIF (with transparency) and BMP. JPEG is left out:
    stb's IDCT differs from libjpeg's (seen: up to 3 levels). Mutation: RGBA composited on black
    fails it; so does 16-bit grey clipped instead of shifted."""
    lib = ctypes.CDLL(str(LIBMTMD))
    lib.stbi_load_from_memory.restype = ctypes.POINTER(ctypes.c_uint8)
    lib.stbi_load_from_memory.argtypes = [ctypes.c_char_p, ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3 + [ctypes.c_int]
    pal = PILImage.fromarray(RGBA[:, :, 0] % 16, "P")
    pal.putpalette(RNG.integers(0, 256, 48).tolist() + [0] * 720)
    grey16 = RNG.integers(0, 65536, (9, 7), dtype=np.uint16)
    rgb16 = RNG.integers(0, 65536, (4, 5, 3), dtype=np.uint16)
    cases = [PNG, _encode(PILImage.fromarray(RGBA, "RGBA"), "PNG"), _encode(PILImage.fromarray(RGB[:, :, 0]), "PNG"),
             _encode(PILImage.fromarray(RGBA[:, :, :2], "LA"), "PNG"), _encode(PILImage.fromarray(RGB[:, :, 0] > 99), "PNG"),
             _encode(pal, "PNG"), _encode(pal, "PNG", transparency=3), _encode(pal, "GIF"), _encode(pal, "GIF", transparency=3),
             _png(7, 9, bit_depth=16, color_type=0, raw=b"".join(b"\x00" + r.astype(">u2").tobytes() for r in grey16)),
             _png(5, 4, bit_depth=16, color_type=2, raw=b"".join(b"\x00" + r.astype(">u2").tobytes() for r in rgb16)),
             _encode(PILImage.fromarray(RGB), "BMP")]
    for i, data in enumerate(cases):
        np.testing.assert_array_equal(load_image(data).pixels, _stb_load(lib, data), err_msg=f"case {i}")


# ---- the Image value ----

def test_digest_covers_pixels_and_shape():
    """Equal pixels give equal digests; one changed byte, or the same bytes in another shape,
    give another. Mutation: hashing the pixel bytes without the shape fails it."""
    a = RNG.integers(0, 256, (2, 6, 3), dtype=np.uint8)
    b = a.copy()
    b[1, 5, 2] ^= 1
    d = {load_image(a).digest, load_image(b).digest, load_image(a.reshape(6, 2, 3)).digest}
    assert len(d) == 3 and load_image(a).digest == load_image(a.copy()).digest
    assert len(load_image(a).digest) == 32


def test_pixels_are_a_read_only_copy():
    """The Image's pixels are read-only and do not alias the caller's array: changing the array
    afterwards changes neither pixels nor digest. Mutation: keeping the caller's (H, W, 3) array
    as is (no copy) fails it."""
    arr = RGB.copy()
    img = load_image(arr)
    arr[:] = 0
    assert img.pixels.any() and img == load_image(RGB)
    with pytest.raises(ValueError):
        img.pixels[0, 0, 0] = 1


# ---- refusals ----

def test_too_many_bytes_refused_before_reading(tmp_path, monkeypatch):
    """Bytes, a file (by its size, never opened) and a data URL (before base64 decoding) over
    max_bytes are refused, naming the image. Mutation: dropping the stat check lets the file be
    opened (the patched open fails the test); dropping the data-URL pre-check reaches b64decode."""
    limits = ImageLimits(max_bytes=len(PNG) - 1)
    assert "image 2:" in _refused(r"^image 2: \d+ bytes, over the limit of", PNG, limits=limits, name="image 2")
    path = tmp_path / "big.png"
    path.write_bytes(PNG)
    monkeypatch.setattr(Path, "open", lambda *a, **k: pytest.fail("the file was opened"))
    _refused(r"^photo\.png: \d+ bytes, over the limit", path, limits=limits, name="photo.png")
    monkeypatch.setattr(image_mod.base64, "b64decode", lambda *a, **k: pytest.fail("decoded"))
    _refused(r"^image 3: \d+ bytes, over the limit", "data:image/png;base64," + base64.b64encode(PNG * 2).decode(),
             limits=ImageLimits(max_bytes=len(PNG)), name="image 3")


def test_decompression_bomb_refused_from_its_header(monkeypatch):
    """An 8000x8000 PNG of under 10 KB (64 Mpx, over the default 50 Mpx) is refused from its
    header, before decoding: Pillow's load is patched to fail the test. The same generator at
    300x300 decodes, so the file is a real image. A 20000x20000 header (past Pillow's own bomb
    ceiling) is refused too, naming the image. Mutation: checking the size after im.load() fails it."""
    small = load_image(_bomb(300))
    assert small.pixels.shape == (300, 300, 3) and not small.pixels.any()
    bomb = _bomb(8000)
    assert len(bomb) < 10_000
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded the bomb"))
    monkeypatch.setattr(PILImage.Image, "load", lambda self: pytest.fail("decoded the bomb"))
    _refused(r"^image 4: 8000x8000 is 64000000 pixels, over the limit of 50000000$", bomb, name="image 4")
    _refused(r"^image 5: .*pixels", _png(20000, 20000, idat=b"junk"), name="image 5")


def test_too_many_pixels_from_an_array_or_a_pil_image():
    """Arrays and PIL images are held to max_pixels too. Mutation: skipping the check for
    arrays fails it."""
    limits = ImageLimits(max_pixels=21 * 34 - 1)
    _refused(r"^image 6: 34x21 is 714 pixels, over the limit of 713$", RGB, limits=limits, name="image 6")
    _refused(r"^image 7: 34x21", PILImage.fromarray(RGB), limits=limits, name="image 7")


def test_malformed_or_unknown_data_says_so():
    """Garbage, a text file, a TIFF (a format outside the list), a PNG cut short and an empty
    byte string each give an InvalidRequestError naming the image and the problem, never a Pillow
    traceback. Mutation: not catching the truncated PNG's OSError at load fails it."""
    _refused(r"^image 1: not a recognised image \(PNG, JPEG, WebP, GIF or BMP\)", b"hello, world")
    _refused(r"^image 2: not a recognised image", b"", name="image 2")
    _refused(r"^image 3: not a recognised image", _encode(PILImage.fromarray(RGB), "TIFF"), name="image 3")
    noisy = _encode(PILImage.fromarray(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "PNG")
    _refused(r"^image 4: malformed PNG data \(", noisy[: len(noisy) // 2], name="image 4")
    _refused(r"^image 5: malformed", _encode(PILImage.fromarray(RGB), "JPEG")[:200], name="image 5")


def test_bad_arrays_paths_and_types():
    """A float array, a 2-channel array, an empty array, a missing file, a directory, another URL
    scheme, an int and a path too long to open (cut short in the message) are refused, each
    naming the image. Mutation: accepting any ndim-3 array fails it."""
    _refused(r"^a: an array must be uint8 \(H, W, 3\) or \(H, W, 4\), got float32", RGB.astype(np.float32), name="a")
    _refused(r"^b: an array must be uint8", RGB[:, :, :2], name="b")
    _refused(r"^c: empty image \(0x0\)", np.zeros((0, 0, 3), np.uint8), name="c")
    _refused(r"^d: no such file '/nonexistent/x\.png'", "/nonexistent/x.png", name="d")
    _refused(r"^e: '/tmp' is not a file", "/tmp", name="e")
    _refused(r"^f: unsupported URL scheme", "ftp://example.com/x.png", name="f")
    _refused(r"^g: unsupported image input of type int", 42, name="g")
    msg = _refused(r"^h: cannot read '/x+\.\.\.': File name too long", "/" + "x" * 5000, name="h")
    assert len(msg) < 200  # the path is cut short in the message


def test_bad_data_urls():
    """A data URL with no comma, bad base64, or a non-image media type is refused. Mutation:
    b64decode without validate=True lets the bad base64 through (to a different error)."""
    _refused(r"^image 1: malformed data URL \(no ','\)", "data:image/png;base64")
    _refused(r"^image 1: malformed base64 in data URL$", "data:image/png;base64,iVBO!!!!")
    _refused(r"^image 1: data URL of type 'text/plain' is not an image", "data:text/plain;base64,aGk=")


class _Resp:
    def __init__(self, data: bytes, length: int | None = None):
        self.data, self.headers = data, {"Content-Length": str(len(data) if length is None else length)}

    def read(self, n: int = -1) -> bytes:
        return self.data if n < 0 else self.data[:n]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_remote_urls_refused_unless_allowed(monkeypatch):
    """An http(s) URL is refused by default without touching the network (the opener fails the
    test if called). Mutation: fetching before checking allow_remote fails it."""
    monkeypatch.setattr(image_mod, "_open_url", lambda *a, **k: pytest.fail("fetched"))
    msg = _refused(r"^image 2: remote image URLs are refused \(example\.com\)", "https://example.com/cat.png", name="image 2")
    assert "allow remote" in msg
    _refused(r"^image 3: remote image URLs are refused", "HTTP://example.com/cat.png", name="image 3")


def test_remote_fetch_when_allowed(monkeypatch):
    """With allow_remote, the URL is fetched once through urllib with the limits' timeout and
    decoded; a download over max_bytes (by Content-Length, or by what arrives) and a failed fetch
    are refused, naming the image. Mutation: reading without a byte cap (read()) fails the
    lying-Content-Length case."""
    calls = []
    def opener(req, timeout):
        calls.append((req.full_url, timeout, req.get_header("User-agent")))
        return _Resp(PNG)
    monkeypatch.setattr(image_mod, "_open_url", opener)
    img = load_image("https://example.com/cat.png", allow_remote=True, limits=ImageLimits(timeout_s=3.5))
    np.testing.assert_array_equal(img.pixels, RGB)
    assert calls == [("https://example.com/cat.png", 3.5, "hearthlm")]
    small = ImageLimits(max_bytes=100)
    _refused(r"^image 2: \d+ bytes, over the limit of 100$", "http://x/y.png", allow_remote=True, limits=small, name="image 2")
    monkeypatch.setattr(image_mod, "_open_url", lambda req, timeout: _Resp(PNG, length=10))
    _refused(r"^image 3: 101 bytes, over the limit of 100$", "http://x/y.png", allow_remote=True, limits=small, name="image 3")
    def fail(req, timeout):
        raise urllib.error.URLError("timed out")
    monkeypatch.setattr(image_mod, "_open_url", fail)
    _refused(r"^image 4: cannot fetch 'http://x/y\.png': .*timed out", "http://x/y.png", allow_remote=True, name="image 4")
