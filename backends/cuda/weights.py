"""Weights on the GPU. Quantized matrices keep their raw GGUF blocks (the kernels read them
as llama.cpp's do: quants.cuh); float matrices (F32, F16, BF16) and vectors become float32
for cuBLAS and the elementwise kernels, and so do the types without a kernel here yet (the IQ,
TQ and MXFP4 types: dequantized once at upload, exactly as gguf.quants does, at 4 bytes a weight)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.core.errors import UnsupportedModelError
from hearthlm.core.weights import QWeight

# ggml type -> kernel name suffix in matmul.cu
QUANT_KERNELS = {int(T.Q4_0): "q4_0", int(T.Q4_1): "q4_1", int(T.Q5_0): "q5_0", int(T.Q5_1): "q5_1",
                 int(T.Q8_0): "q8_0", int(T.Q2_K): "q2_k", int(T.Q3_K): "q3_k", int(T.Q4_K): "q4_k",
                 int(T.Q5_K): "q5_k", int(T.Q6_K): "q6_k"}
# tokens a quantized product takes in mmvq (matmul.cu), in launches of 8 (its MAX_TOKENS: the
# accumulators live in registers), each reading the weight again; above: dequantize + cuBLAS
MMVQ_MAX_TOKENS = 32
FLOAT_TYPES = frozenset(int(t) for t in (T.F32, T.F16, T.BF16))
DEQUANTIZED_TYPES = frozenset(int(t) for t in (  # float32 on the device until they have kernels
    T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.TQ1_0, T.TQ2_0, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
    T.IQ1_S, T.IQ1_M))
SUPPORTED_TYPES = FLOAT_TYPES | frozenset(QUANT_KERNELS) | DEQUANTIZED_TYPES


@dataclass(eq=False)
class CudaWeight:
    """A weight matrix on the device; `shape` is (n_rows, n_cols) of the logical matrix."""

    ggml_type: int
    shape: tuple[int, int]
    raw: Any = None  # quantized: cupy uint8 (n_rows, row_bytes), the file's blocks
    f: Any = None    # float types: cupy float32 (n_rows, n_cols)

    @property
    def kernel(self) -> str:
        return QUANT_KERNELS[self.ggml_type]


def quantized(w) -> bool:
    """Whether a prepared weight is raw quantized blocks (read by our kernels, mmvq) rather than
    floats (cuBLAS) or an activation."""
    return isinstance(w, CudaWeight) and w.raw is not None


def type_name(ggml_type: int) -> str:
    return T(ggml_type).name if ggml_type in T._value2member_map_ else str(ggml_type)


def upload(cp, w: QWeight):
    """A cupy float32 array for vectors and float matrices, else a CudaWeight of raw blocks."""
    from hearthlm.backends.reference import dequantize
    t = int(w.ggml_type)
    if t not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"{w.name}: the cuda backend cannot run weights of type {type_name(t)}")
    if len(w.shape) == 1:
        return cp.asarray(np.ascontiguousarray(dequantize(w), np.float32))
    if len(w.shape) != 2:
        raise UnsupportedModelError(f"{w.name}: {len(w.shape)}-d weights are not supported by the cuda backend")
    n_rows, n_cols = (int(s) for s in w.shape)
    if t in FLOAT_TYPES or t in DEQUANTIZED_TYPES:
        return CudaWeight(t, (n_rows, n_cols), f=cp.asarray(np.ascontiguousarray(dequantize(w), np.float32)))
    block, size = GGML_QUANT_SIZES[T(t)]
    raw = np.ascontiguousarray(np.asarray(w.raw, np.uint8)).reshape(n_rows, -1)
    if n_cols % block or raw.shape[1] != n_cols // block * size:
        raise UnsupportedModelError(f"{w.name}: {type_name(t)} weight of shape {w.shape} is not whole blocks")
    return CudaWeight(t, (n_rows, n_cols), raw=cp.asarray(raw))
