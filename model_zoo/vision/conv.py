"""The patch embedding's precision in llama.cpp: clip.cpp's build_inp is ggml_conv_2d, whose im2col is F16 for
any kernel but BF16, so the pixels and the kernel are multiplied at half precision. A projector that wants
llama.cpp's rows takes the same values (an F32 patch embedding moves the tiny towers' rows by 3-5e-4 of their
largest, 1e-4 at half precision)."""
from __future__ import annotations

import gguf
import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.weights import QWeight


def half(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (to nearest, as ggml's F32 -> F16)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def half_kernel(weights: dict, name: str, where: str) -> None:
    """Replace the conv kernel `name` (a float matrix) by its values at half precision, as F32."""
    qw = weights[name]
    if qw.ggml_type == 30:  # BF16: ggml's im2col stays F32
        return
    try:
        a = qw.raw.view(np.float32) if qw.ggml_type == 0 else gguf.quants.dequantize(qw.raw, qw.ggml_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{where}: tensor {name!r} of ggml type {qw.ggml_type} cannot be read: {e}") from e
    h = np.ascontiguousarray(half(np.asarray(a).reshape(qw.shape)))
    weights[name] = QWeight(name, 0, h.shape, h.view(np.uint8))
