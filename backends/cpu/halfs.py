"""F16 and BF16 weights kept at 2 bytes a weight (float32 copies would double a model's memory
and the bytes each decode token streams). Rows are widened to float32 into a small per-thread
buffer, then dotted with each token; for many tokens, matmul.py widens tiles for BLAS.

numba has no float16 and no scalar bitcast, so the widening writes float32 bit patterns into
a uint32 buffer viewed as float32. F16: sign | exponent+mantissa << 13 is the value times
2**-112 (also for subnormals, which become float32 subnormals); one multiply rebiases it.
Inf/NaN get an all-ones exponent first, which the multiply keeps.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

_JIT = dict(cache=True, fastmath=True, nogil=True)


# float16 values held as uint16 bits (quantization scales, the KV cache): the conversions are
# LLVM's fpext / fptrunc (vcvtph2ps / vcvtps2ph where the CPU has F16C), exact one way and
# round-to-nearest-even the other, as numpy's float16 casts.

@intrinsic
def f32(typingctx, v):
    """v as float32: float16 bits (uint16) widened, a float converted."""
    def codegen(context, builder, sig, args):
        if sig.args[0] == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return context.cast(builder, args[0], sig.args[0], types.float32)
    return types.float32(v), codegen


@intrinsic
def bits_as_f32(typingctx, i):
    """The float32 whose bit pattern is the int32 i."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def like(typingctx, arr, v):
    """The float v as an element of arr: float16 bits for a uint16 array, else arr's float type."""
    def codegen(context, builder, sig, args):
        dt = sig.args[0].dtype
        x = context.cast(builder, args[1], sig.args[1], types.float32)
        if dt == types.uint16:
            return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))
        return context.cast(builder, x, types.float32, dt)
    return arr.dtype(arr, v), codegen
ROWS_PER_TASK = 32  # rows sharing one widening buffer in the parallel loop
_F16_REBIAS = np.float32(2.0**112)


@numba.njit(inline="always", **_JIT)
def _widen_row(h, is_f16, bits, f32):
    """h (n,) uint16 -> f32 (n,) float32; bits is f32's uint32 view (the same memory)."""
    n = h.shape[0]
    if is_f16:
        for j in range(n):
            v = np.uint32(h[j])
            em = v & np.uint32(0x7FFF)
            inf_nan = np.uint32(0x7F800000) if em >= np.uint32(0x7C00) else np.uint32(0)
            bits[j] = ((v & np.uint32(0x8000)) << np.uint32(16)) | (em << np.uint32(13)) | inf_nan
        for j in range(n):
            f32[j] = f32[j] * _F16_REBIAS
    else:
        for j in range(n):
            bits[j] = np.uint32(h[j]) << np.uint32(16)


@numba.njit(parallel=True, **_JIT)
def dot_half(w, is_f16, x, y):
    """w (n_rows, n_cols) uint16 bits, x (n_tok, n_cols) float32 -> y (n_tok, n_rows)."""
    n_rows, n_cols = w.shape
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        f32 = np.empty(n_cols, dtype=np.float32)
        bits = f32.view(np.uint32)
        for r in range(task * ROWS_PER_TASK, min((task + 1) * ROWS_PER_TASK, n_rows)):
            _widen_row(w[r], is_f16, bits, f32)
            for t in range(x.shape[0]):
                acc = np.float32(0.0)
                for j in range(n_cols):
                    acc += f32[j] * x[t, j]
                y[t, r] = acc


@numba.njit(**_JIT)
def widen_rows(w, is_f16, rows, out):
    """out[i] = row rows[i] of w as float32 (n, n_cols). Serial, like the other tile kernels."""
    bits = out.view(np.uint32)
    for i in range(rows.shape[0]):
        _widen_row(w[rows[i]], is_f16, bits[i], out[i])
