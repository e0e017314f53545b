"""Turning what an app passes as an image into RGB pixels, as llama.cpp's mtmd-helper does with
stb_image (3 channels): alpha dropped, not blended; 16-bit samples cut to their high byte; a GIF's
first frame, transparent pixels black; EXIF orientation ignored. Decoding is Pillow's, with
limits checked first: the byte size before reading, the pixel count from the header before decoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import struct
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hearthlm.core.errors import InvalidRequestError

_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may try; other plugins never run
_KNOWN = "PNG, JPEG, WebP, GIF or BMP"
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error, zlib.error)
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_open_url = urllib.request.urlopen  # tests swap this for a fake opener


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024   # encoded size (a file, bytes, a data URL's payload, a download)
    max_pixels: int = 50_000_000        # width * height, checked from the header before decoding
    timeout_s: float = 10.0             # a remote fetch (allow_remote=True)


@dataclass(frozen=True, eq=False)
class Image:
    """Decoded pixels and their identity. Equal digests mean equal pixels (the cache keys use it)."""
    pixels: np.ndarray  # (H, W, 3) uint8, read-only
    digest: bytes       # blake2b-256 of the shape and the pixels

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Image({self.width}x{self.height}, digest={self.digest.hex()[:16]}...)"


def _make(pixels: np.ndarray) -> Image:
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    h = hashlib.blake2b(f"rgb8 {pixels.shape[0]}x{pixels.shape[1]};".encode(), digest_size=32)
    h.update(memoryview(pixels).cast("B"))
    pixels.setflags(write=False)
    return Image(pixels, h.digest())


def _check_bytes(n: int, limits: ImageLimits, name: str) -> None:
    if n > limits.max_bytes:
        raise InvalidRequestError(f"{name}: {n} bytes, over the limit of {limits.max_bytes}")


def _check_pixels(width: int, height: int, limits: ImageLimits, name: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"{name}: empty image ({width}x{height})")
    if width * height > limits.max_pixels:
        raise InvalidRequestError(f"{name}: {width}x{height} is {width * height} pixels, over the limit of {limits.max_pixels}")


def load_image(src, *, limits: ImageLimits = ImageLimits(), allow_remote: bool = False, name: str = "image 1") -> Image:
    """An Image from a file path (str or Path), encoded bytes (PNG, JPEG, WebP, GIF, BMP), a
    `data:image/...;base64,` URL, an http(s) URL (only with allow_remote), a uint8 array
    (H, W, 3) or (H, W, 4), a PIL image, or an Image (returned as is). Every refusal is an
    InvalidRequestError whose message starts with `name`."""
    if isinstance(src, Image):
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _decode(bytes(src), limits, name)
    if isinstance(src, np.ndarray):
        return _from_array(src, limits, name)
    if isinstance(src, os.PathLike):
        return _decode(_read_file(Path(src), limits, name), limits, name)
    if isinstance(src, str):
        if src[:5].lower() == "data:":
            return _decode(_data_url(src, limits, name), limits, name)
        if src[:7].lower() == "http://" or src[:8].lower() == "https://":
            return _decode(_fetch(src, limits, allow_remote, name), limits, name)
        if _URL_SCHEME.match(src):
            raise InvalidRequestError(f"{name}: unsupported URL scheme in {_short(src, 40)} (use a path, data: or http(s):)")
        return _decode(_read_file(Path(src), limits, name), limits, name)
    pil = _pil_module()
    if isinstance(src, pil.Image):
        _check_pixels(src.width, src.height, limits, name)
        return _make(_decoded(src, name))
    raise InvalidRequestError(f"{name}: unsupported image input of type {type(src).__name__}")


def _pil_module():
    from PIL import Image as PILImage  # imported on first use: text-only apps never pay for it
    return PILImage


def _from_array(arr: np.ndarray, limits: ImageLimits, name: str) -> Image:
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise InvalidRequestError(f"{name}: an array must be uint8 (H, W, 3) or (H, W, 4), got {arr.dtype} {arr.shape}")
    _check_pixels(arr.shape[1], arr.shape[0], limits, name)
    return _make(np.array(arr[:, :, :3], dtype=np.uint8, order="C"))  # a copy: the caller keeps theirs


def _short(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _read_file(path: Path, limits: ImageLimits, name: str) -> bytes:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise InvalidRequestError(f"{name}: {_short(str(path))} is not a file")
        _check_bytes(size, limits, name)
        with path.open("rb") as f:
            data = f.read(limits.max_bytes + 1)
    except FileNotFoundError:
        raise InvalidRequestError(f"{name}: no such file {_short(str(path))}") from None
    except OSError as e:
        raise InvalidRequestError(f"{name}: cannot read {_short(str(path))}: {e.strerror or e}") from None
    _check_bytes(len(data), limits, name)  # the file grew since stat
    return data


def _data_url(url: str, limits: ImageLimits, name: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequestError(f"{name}: malformed data URL (no ',')")
    params = head[5:].split(";")
    media = params[0].strip().lower()
    if media and not (media.startswith("image/") or media == "application/octet-stream"):
        raise InvalidRequestError(f"{name}: data URL of type {media!r} is not an image")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        payload = "".join(payload.split())
        _check_bytes(len(payload) // 4 * 3, limits, name)  # before decoding
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{name}: malformed base64 in data URL") from None
    _check_bytes(len(data), limits, name)
    return data


def _fetch(url: str, limits: ImageLimits, allow_remote: bool, name: str) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or "?"
    if not allow_remote:
        raise InvalidRequestError(f"{name}: remote image URLs are refused ({host}); "
                                  "pass the bytes, a data: URL or a path, or allow remote images")
    req = urllib.request.Request(url, headers={"User-Agent": "hearthlm"})
    try:
        with _open_url(req, timeout=limits.timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit():
                _check_bytes(int(length), limits, name)
            data = resp.read(limits.max_bytes + 1)
    except InvalidRequestError:
        raise
    except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise InvalidRequestError(f"{name}: cannot fetch {_short(url)}: {e}") from None
    _check_bytes(len(data), limits, name)
    return data


def _decode(data: bytes, limits: ImageLimits, name: str) -> Image:
    _check_bytes(len(data), limits, name)
    pil = _pil_module()
    try:
        im = pil.open(io.BytesIO(data), formats=_FORMATS)  # reads the header only
    except pil.UnidentifiedImageError:
        raise InvalidRequestError(f"{name}: not a recognised image ({_KNOWN}), or its header is malformed") from None
    except pil.DecompressionBombError as e:  # Pillow's own ceiling, past ours
        raise InvalidRequestError(f"{name}: too many pixels ({e})") from None
    except _DECODE_ERRORS as e:
        raise InvalidRequestError(f"{name}: malformed image ({e})") from None
    _check_pixels(im.width, im.height, limits, name)  # before anything is decoded
    return _make(_decoded(im, name))


def _decoded(im, name: str) -> np.ndarray:
    """(H, W, 3) uint8 of a PIL image's first frame, the way stb_image gives 3 channels."""
    try:
        im.seek(0)
        im.load()
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit gray PNG: stb keeps the high byte
            gray = (np.asarray(im).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
            return np.repeat(gray[:, :, None], 3, axis=2)
        if im.mode in ("P", "L") and im.format == "GIF" and "transparency" in im.info:
            rgb = np.array(im.convert("RGB"))
            rgb[np.asarray(im) == im.info["transparency"]] = 0  # stb leaves a GIF's transparent pixels black
            return rgb
        return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))  # RGBA/LA/P: alpha dropped
    except _DECODE_ERRORS as e:
        fmt = im.format or "image"
        raise InvalidRequestError(f"{name}: malformed {fmt} data ({e})") from None
