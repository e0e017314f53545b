"""KV cache element types (Session.open(kv_cache_type=...)), as llama.cpp's -ctk / -ctv:
"f16", the backend's own (float16 on the CPU where it converts natively, float32 on the
reference and cuda backends), or ggml's q8_0 / q4_0 blocks of 32 values along head_dim:
q8_0 {f16 d; int8 qs[32]} (34 bytes), q4_0 {f16 d; u8 qs[16]} (18 bytes, value j < 16 the low
nibble of qs[j], 16 + j the high one, each (q - 8) * d). A quantized cache is (n_slots, h_kv,
row bytes): a slot's row per head is its blocks, so copying K/V by slot copies bytes. Its
dtype says which layout it holds (int8: q8_0, uint8: q4_0): the kernels and the prompt
cache's key read it from the array. Nothing of ours is imported: backends use this."""
from __future__ import annotations

import numpy as np

KV_TYPES = ("f16", "q8_0", "q4_0")
QK = 32  # values per block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
_STORAGE = {"q8_0": np.dtype(np.int8), "q4_0": np.dtype(np.uint8)}
_BY_DTYPE = {v: k for k, v in _STORAGE.items()}


def check(kv_type: str, kv_dims) -> str | None:
    """Why `kv_type` cannot hold these layers' K/V ((n_head_kv, head_dim) each; (0, 0) for a
    layer without attention), or None when it can."""
    if kv_type not in KV_TYPES:
        return f"kv_cache_type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}"
    bad = sorted({d for h, d in kv_dims if h and d % QK}) if kv_type != "f16" else []
    if bad:
        return (f"kv_cache_type {kv_type} stores blocks of {QK} values along head_dim; this model's head_dim "
                f"is {bad[0]}, not a multiple of {QK}: use f16")
    return None


def storage(kv_type: str, default: np.dtype, h: int, d: int) -> tuple[tuple[int, int], np.dtype]:
    """(per-slot shape, dtype) of a cache of this type; `default` is the backend's own (f16)."""
    if kv_type == "f16":
        return (h, d), np.dtype(default)
    return (h, d // QK * BLOCK_BYTES[kv_type]), _STORAGE[kv_type]


def quant_of(cache) -> str | None:
    """"q8_0" / "q4_0" for a quantized cache (numpy or cupy array), else None."""
    return _BY_DTYPE.get(np.dtype(cache.dtype))


def head_dim(cache) -> int:
    """The values per row of a cache, quantized or not."""
    q = quant_of(cache)
    return cache.shape[-1] if q is None else cache.shape[-1] // BLOCK_BYTES[q] * QK


def name_of(cache) -> str:
    """The cache's element type as the prompt cache keys it: a quantized type's name, else the
    dtype string (what an f16 key always was, so its files stay valid)."""
    return quant_of(cache) or np.dtype(cache.dtype).str
