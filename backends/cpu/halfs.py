"""F16 and BF16 weights kept at 2 bytes a weight (float32 copies would double a model's memory
and the bytes each decode token streams). Rows are widened to float32 into a small per-thread
buffer, then dotted with each token; for many tokens, widened rows are multiplied into a
token a vector lane (matmul_tokens, which also takes float32 weights).

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
from numba.core import cgutils
from numba.extending import intrinsic, overload

_JIT = dict(cache=True, fastmath=True, nogil=True)


# float16 values held as uint16 bits (quantization scales, the KV cache). Where the target CPU
# converts natively (x86 with F16C: vcvtph2ps / vcvtps2ph; ARMv8), these are LLVM's fpext /
# fptrunc, exact one way and round-to-nearest-even the other, as numpy's casts. Elsewhere LLVM
# would call compiler-rt, which numba's JIT does not link: widening is then the bit arithmetic
# of _widen_row below, and narrowing is not offered (the CPU backend keeps a float32 KV cache).
# The features numba compiles with, by its own rule: NUMBA_CPU_FEATURES where set ("generic", for
# caches that travel, sets none), else the host's, even under another NUMBA_CPU_NAME. So an AVX2-only
# CPU is emulated by both: NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx,+avx2,+fma,+f16c,...
# (Makefile's AVX2_FEATURES). The name alone once chose the generic kernels here while numba still
# emitted AVX-512: the "AVX2" figures taken that way were neither machine's.
TARGET_FEATURES = (numba.config.CPU_FEATURES if numba.config.CPU_FEATURES is not None
                   else llb.get_host_cpu_features().flatten())
NATIVE_HALF = "+f16c" in TARGET_FEATURES or not llb.get_process_triple().startswith(("x86", "i386", "i686"))


def _ptr(context, builder, arrty, arr, inds):
    """Address of arr[i, j] (no wraparound, no bounds check: the callers index in range)."""
    a = context.make_array(arrty)(context, builder, arr)
    inds = [context.cast(builder, v, t, types.intp) for v, t in inds]
    return cgutils.get_item_pointer2(context, builder, data=a.data, shape=cgutils.unpack_tuple(builder, a.shape),
                                     strides=cgutils.unpack_tuple(builder, a.strides), layout=arrty.layout,
                                     inds=inds, wraparound=False, boundscheck=False)


def _vec_ptr(context, builder, arrty, arr, inds, vty):
    return builder.bitcast(_ptr(context, builder, arrty, arr, inds), vty.as_pointer())


def _splat(builder, s, vty):
    """The scalar s in every lane of a vector of type vty."""
    i32 = ir.IntType(32)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), s, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(i32, vty.count), [0] * vty.count))


def _call(builder, name, ret, args):
    fty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fty, name), args)


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


# Many tokens (8 and up: batched decode, prefill, an encoder's text): a token per vector lane.
# x goes in transposed, VW tokens a vector; each weight, widened once per block of RB rows into
# a per-thread buffer, is broadcast and multiplied into the accumulators of up to 3 token
# vectors, so one FMA does VW tokens' products and a block's RB x 3 accumulators stay in
# registers for the whole row (no sums across lanes). ~2x BLAS on one thread, both cores busy
# without BLAS's own threads (which spin against numba's). A token's sum is fma(w[k], x[k], acc)
# over k in order, in its own lane: bitwise the same whatever else is in the call.
VW = 16 if "+avx512f" in TARGET_FEATURES else 8  # tokens a vector
RB = 8 if VW == 16 else 4  # rows a block: RB x 3 accumulators + 3 token vectors + 1 weight in registers
X_CHUNK_BYTES = 1 << 20  # x's share one pass of the rows reads: within a core's L2


def _make_block(n_v):
    @intrinsic
    def block(typingctx, wb, xt, yb, t0):
        """yb[r, t0:t0 + VW*n_v] = wb[r] . xt[:, those tokens] for the RB rows of wb."""
        def codegen(context, builder, sig, args):
            wb_v, xt_v, yb_v, t0_v = args
            ta, ip = sig.args, types.intp
            cst = lambda v: context.get_constant(ip, v)  # noqa: E731
            vf = ir.VectorType(ir.FloatType(), VW)
            t0 = context.cast(builder, t0_v, ta[3], ip)
            n_k = cgutils.unpack_tuple(builder, context.make_array(ta[0])(context, builder, wb_v).shape)[1]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * VW)) for _ in range(n_v)]
                    for _ in range(RB)]  # allocas: mem2reg keeps them in registers
            with cgutils.for_range(builder, n_k) as loop:
                k = loop.index
                xs = [builder.load(_vec_ptr(context, builder, ta[1], xt_v, [(k, ip), (builder.add(t0, cst(VW * v)), ip)], vf),
                                   align=4) for v in range(n_v)]
                for r in range(RB):
                    wv = _splat(builder, builder.load(_ptr(context, builder, ta[0], wb_v, [(cst(r), ip), (k, ip)])), vf)
                    for v in range(n_v):
                        acc = builder.load(accs[r][v])
                        builder.store(_call(builder, f"llvm.fma.v{VW}f32", vf, [wv, xs[v], acc]), accs[r][v])
            for r in range(RB):
                for v in range(n_v):
                    p = _vec_ptr(context, builder, ta[2], yb_v, [(cst(r), ip), (builder.add(t0, cst(VW * v)), ip)], vf)
                    builder.store(builder.load(accs[r][v]), p, align=4)
            return context.get_dummy_value()
        return types.none(wb, xt, yb, t0), codegen
    return block


_BLOCK1, _BLOCK2, _BLOCK3 = _make_block(1), _make_block(2), _make_block(3)


def _rows_f32(w, r0, nr, is_f16, wb, bits):
    """Rows r0..r0+nr of w as float32 into wb[:nr]."""


@overload(_rows_f32)
def _rows_f32_impl(w, r0, nr, is_f16, wb, bits):
    if w.dtype == types.float32:
        def impl(w, r0, nr, is_f16, wb, bits):
            for r in range(nr):
                wb[r, :] = w[r0 + r]
    else:
        def impl(w, r0, nr, is_f16, wb, bits):
            for r in range(nr):
                _widen_row(w[r0 + r], is_f16, bits[r], wb[r])
    return impl


@numba.njit(parallel=True, cache=True, nogil=True)
def _x_chunks(x, n_chunks, width):
    """x (T, K) -> (n_chunks, K, width): chunk c holds tokens c*width.. transposed, zeros past T."""
    n_tok, n_k = x.shape
    xc = np.empty((n_chunks, n_k, width), np.float32)
    for kb in prange((n_k + 63) // 64):
        for c in range(n_chunks):
            for k in range(kb * 64, min(n_k, kb * 64 + 64)):
                for j in range(width):
                    t = c * width + j
                    xc[c, k, j] = x[t, k] if t < n_tok else np.float32(0.0)
    return xc


@numba.njit(parallel=True, cache=True, nogil=True)
def matmul_tokens(w, is_f16, x, y, n_threads):
    """w (n_rows, n_cols): uint16 bits of F16 (is_f16) or BF16, or float32; x (n_tok, n_cols)
    float32 -> y (n_tok, n_rows); n_threads: numba.get_num_threads() (read inside, it would keep
    the function from numba's cache)."""
    n_rows, n_k = w.shape
    n_tok = x.shape[0]
    nv = (n_tok + VW - 1) // VW
    cv = min(nv, max(1, min(6, X_CHUNK_BYTES // (n_k * VW * 4))))  # token vectors a chunk
    width = cv * VW
    n_chunks = (nv + cv - 1) // cv
    xc = _x_chunks(x, n_chunks, width)
    n_rb = (n_rows + RB - 1) // RB
    n_th = max(1, min(n_threads, n_rb))
    for th in prange(n_th):
        wb = np.zeros((RB, n_k), np.float32)
        bits = wb.view(np.uint32)
        yb = np.empty((RB, width), np.float32)
        for c in range(n_chunks):
            n = min(cv, nv - c * cv)
            xt = xc[c]
            for rb in range(th * n_rb // n_th, (th + 1) * n_rb // n_th):
                r0 = rb * RB
                nr = min(RB, n_rows - r0)
                _rows_f32(w, r0, nr, is_f16, wb, bits)  # a partial block's other rows: stale, unread
                v = 0
                while v + 3 <= n:
                    _BLOCK3(wb, xt, yb, v * VW)
                    v += 3
                if n - v == 2:
                    _BLOCK2(wb, xt, yb, v * VW)
                elif n - v == 1:
                    _BLOCK1(wb, xt, yb, v * VW)
                for j in range(min(n_tok - c * width, n * VW)):
                    for r in range(nr):
                        y[c * width + j, r0 + r] = yb[r, j]
