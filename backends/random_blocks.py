"""Random GGUF blocks of the quantized types, with sane scales: the one table of where each
type keeps its float16 scale(s), for the kernel benchmarks, the tests and the benchmark models,
which need real layouts where gguf.quants cannot quantize (K-quants, most IQ types)."""
from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

F16_FIELDS = {  # byte offsets of each block's float16 scales (ggml-common.h's block_* structs)
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,),
    T.IQ3_S: (0,), T.IQ1_S: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}
KQUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
IQUANTS = (T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.TQ1_0, T.TQ2_0, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
           T.IQ1_S, T.IQ1_M)


def random_blocks(qtype, n_rows: int, n_cols: int, rng, lo: float = 0.001, hi: float = 0.02) -> np.ndarray:
    """Random bytes (n_rows, row_bytes) in qtype's blocks, every scale finite and in [lo, hi)."""
    qtype = T(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_rows * n_cols // block, size), dtype=np.uint8)
    half = lambda: rng.uniform(lo, hi, raw.shape[0]).astype(np.float16)  # noqa: E731
    if qtype == T.MXFP4:  # an e8m0 exponent byte: 2^(e - 128), about 2^-8 .. 2^-4
        raw[:, 0] = rng.integers(120, 124, raw.shape[0])
    elif qtype == T.IQ1_M:  # d's 16 bits are the top nibbles of the four uint16 scales (bytes 48..55)
        bits = half().view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[:, 48:56] = sc.view(np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        raw[:, off:off + 2] = half().view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(raw.reshape(n_rows, -1))
