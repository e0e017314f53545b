"""F16 and BF16 weights kept at 2 bytes a weight (float32 copies would double a model's memory
and the bytes each decode token streams). Rows are widened to float32 into a small per-thread
buffer, then dotted with each token; for many tokens, matmul.py widens tiles for BLAS.

numba has no float16 and no scalar bitcast, so the widening writes float32 bit patterns into
a uint32 buffer viewed as float32. F16: sign | exponent+mantissa << 13 is the value times
2**-112 (also for subnormals, which become float32 subnormals); one multiply rebiases it.
Inf/NaN get an all-ones exponent first, which the multiply keeps.
"""

import llvmlite.binding as llb
import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

_JIT = dict(cache=True, fastmath=True, nogil=True)


# float16 values held as uint16 bits (quantization scales, the KV cache). Where the target CPU
# converts natively (x86 with F16C: vcvtph2ps / vcvtps2ph; ARMv8), these are LLVM's fpext /
# fptrunc, exact one way and round-to-nearest-even the other, as numpy's casts. Elsewhere LLVM
# would call compiler-rt, which numba's JIT does not link: widening is then the bit arithmetic
# of _widen_row below, and narrowing is not offered (the CPU backend keeps a float32 KV cache).
# numba compiles for the host unless NUMBA_CPU_NAME names a target (e.g. "generic", for caches
# that travel): features are the target's.
TARGET_FEATURES = (llb.get_host_cpu_features().flatten() if numba.config.CPU_NAME in (None, "host")
                   else (numba.config.CPU_FEATURES or ""))
NATIVE_HALF = "+f16c" in TARGET_FEATURES or not llb.get_process_triple().startswith(("x86", "i386", "i686"))


def widen(builder, bits):
    """LLVM IR: i16 (or <n x i16>) float16 bits -> float (or <n x float>), exactly."""
    vec = isinstance(bits.type, ir.VectorType)
    n = bits.type.count if vec else 1
    fty = ir.VectorType(ir.FloatType(), n) if vec else ir.FloatType()
    if NATIVE_HALF:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n) if vec else ir.HalfType()), fty)
    ity = ir.VectorType(ir.IntType(32), n) if vec else ir.IntType(32)
    c = lambda v: ir.Constant(ity, [v] * n if vec else v)  # noqa: E731
    h = builder.zext(bits, ity)
    body = builder.shl(builder.and_(h, c(0x7FFF)), c(13))  # the value times 2**-112, subnormals too
    special = builder.icmp_unsigned(">=", builder.and_(h, c(0x7C00)), c(0x7C00))  # inf, NaN
    body = builder.select(special, builder.or_(body, c(0x7F800000)), body)
    mag = builder.fmul(builder.bitcast(body, fty), ir.Constant(fty, [2.0**112] * n if vec else 2.0**112))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(builder.bitcast(mag, ity), sign), fty)


@intrinsic
def f32(typingctx, v):
    """v as float32: float16 bits (uint16) widened, a float converted."""
    def codegen(context, builder, sig, args):
        if sig.args[0] == types.uint16:
            return widen(builder, args[0])
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
    """The float v as an element of arr: float16 bits for a uint16 array (targets with native
    conversions only), else arr's float type."""
    if arr.dtype == types.uint16 and not NATIVE_HALF:
        raise numba.core.errors.TypingError("float16 stores need a CPU that converts natively (F16C)")

    def codegen(context, builder, sig, args):
        dt = sig.args[0].dtype
        x = context.cast(builder, args[1], sig.args[1], types.float32)
        if dt == types.uint16:
            return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))
        return context.cast(builder, x, types.float32, dt)
    return arr.dtype(arr, v), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern of the float32 x, as a uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@numba.njit(inline="always", cache=True, nogil=True)
def half_bits_soft(x):
    """float32 -> float16 bits, round to nearest even (numpy's cast), by bit arithmetic: half
    subnormals through one float add that rounds at their 2**-24 step (F. Giesen's float_to_half_rtne)."""
    u = f32_bits(np.float32(x))
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    u = u & np.uint32(0x7FFFFFFF)
    if u >= np.uint32(0x47800000):  # 2**16 and up: inf; NaN stays NaN
        return sign | (np.uint16(0x7E00) if u > np.uint32(0x7F800000) else np.uint16(0x7C00))
    if u < np.uint32(0x38800000):  # below 2**-14: a half subnormal or zero
        return sign | np.uint16(f32_bits(bits_as_f32(np.int32(u)) + np.float32(0.5)) - np.uint32(0x3F000000))
    odd = (u >> np.uint32(13)) & np.uint32(1)
    return sign | np.uint16((u + np.uint32(0xC8000FFF) + odd) >> np.uint32(13))  # rebias by (15 - 127) << 23


@intrinsic
def _half_bits_native(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


# float32 -> float16 bits (the quantized KV cache's scales): the CPU's conversion where it has one
half_bits = _half_bits_native if NATIVE_HALF else half_bits_soft


ROWS_PER_TASK = 32  # rows sharing one widening buffer in the parallel loop
_F16_REBIAS = np.float32(2.0**112)


@numba.njit(inline="always", **_JIT)
def _widen_row(h, is_f16, bits, out):
    """h (n,) uint16 -> out (n,) float32; bits is out's uint32 view (the same memory)."""
    n = h.shape[0]
    if is_f16 and NATIVE_HALF:  # vcvtph2ps: ~3x the bit arithmetic on rows in cache, the same values
        for j in range(n):
            out[j] = f32(h[j])
    elif is_f16:
        for j in range(n):
            v = np.uint32(h[j])
            em = v & np.uint32(0x7FFF)
            inf_nan = np.uint32(0x7F800000) if em >= np.uint32(0x7C00) else np.uint32(0)
            bits[j] = ((v & np.uint32(0x8000)) << np.uint32(16)) | (em << np.uint32(13)) | inf_nan
        for j in range(n):
            out[j] = out[j] * _F16_REBIAS
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
