"""The patch embedding's precision in llama.cpp: clip.cpp's build_inp is ggml_conv_2d, whose im2col is F16 for
any kernel but BF16, so the pixels and the kernel are multiplied at half precision. A projector that wants
llama.cpp's rows takes the same values (an F32 patch embedding moves the tiny towers' rows by 3-5e-4 of their
largest, 1e-4 at half precision). Also how the projectors read a tensor's values (floats)."""
from __future__ import annotations

import gguf
import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.weights import QWeight


def half(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (to nearest, as ggml's F32 -> F16)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def floats(qw: QWeight, where: str) -> np.ndarray:
    """A float (or quantized) tensor's values as float32 in its own shape; a type gguf cannot dequantize is a
    ModelLoadError naming the tensor."""
    try:
        a = qw.raw.view(np.float32) if qw.ggml_type == 0 else gguf.quants.dequantize(qw.raw, qw.ggml_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{where}: tensor {qw.name!r} of ggml type {qw.ggml_type} cannot be read: {e}") from e
    return np.asarray(a, np.float32).reshape(qw.shape)


def half_kernel(weights: dict, name: str, where: str) -> None:
    """Replace the conv kernel `name` (a float matrix) by its values at half precision, as F32."""
    qw = weights[name]
    if qw.ggml_type == 30:  # BF16: ggml's im2col stays F32
        return
    h = np.ascontiguousarray(half(floats(qw, where)))
    weights[name] = QWeight(name, 0, h.shape, h.view(np.uint8))
