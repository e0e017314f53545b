"""Integer dot products of packed weight rows with int8-quantized activations (every matmul
of the quantized types below matmul.BLAS_MIN_TOKENS tokens).

Sub-block k of a row holds weight = d*(code + c) + m; activations are x = xd*xq per 32 (int8
codes, amax/127: ggml's q8_0), and xs = xd*sum(xq) per sub-block, so the sub-block's share of
the dot product is d*xd*sum(code*xq) + (m + c*d)*xs: integers inside, one float multiply-add per
sub-block. Codes go in as unsigned bytes (int8 ones as s + 128, c lower by I8_SHIFT) because
vpdpbusd multiplies unsigned by signed bytes: one instruction per row and 64 weights, lane i
summing weights 4i..4i+3 (without AVX512-VNNI, two pmaddwd give the same integers).

Rows go 16 at a time: a transposing tree of shuffles and adds turns 16 rows' <16 x i32> of
partial sums into vectors of the 16 rows' sums per sub-block, and the float update runs on
vectors of 16 rows (qtypes interleaves each block of 16 rows and its scales so that this reads
one stream). Summed a row at a time, each sum would end in a horizontal reduction and a scalar
update, which cost more than the products (2.5-3x slower, measured on cache-resident weights).
Rows past the last whole 16 take the scalar loops below, which compute the same thing.

5-bit codes ("nib5": Q5_0, Q5_1, Q5_K) are read as nibbles plus a bit plane, 0.625 bytes a
weight against 1 for int8 codes (decode reads memory; 1.3x on a 46 MB Q5_0 matvec). Unpacking
them costs instructions, so beyond UNPACK_MIN_TOKENS tokens a block's codes are unpacked once
into an int8 scratch block and the i8 path runs on it; both paths give the products the same
unsigned bytes (code + 128) and the same c, so a token's result does not depend on which ran.

Many tokens (batched decode, prefill) go through the same kernels, two tokens at a time within
each block of rows (a block's codes loaded and unpacked once for both, and in L1 for the next
pair). Against int16 activations and pmaddwd (this kernel's previous form), int8 and vpdpbusd
measured 1.5x on 512-token Q5_0/Q8_0 matmuls and 1.4x on Q6_K; the error of int8 activations is
llama.cpp's own (q8_0 activations), ~3e-5 NMSE on random data.

Batch invariance: a token's result is computed alone, by the same operations whatever else is
in its batch; the float update per row,
    y = y + ((d * xd) * float(s) + (m + c*d) * xs)
in sub-block order, is plain IEEE operations (no fastmath: no reassociation, no FMA
contraction; the integer sums are exact in any order), the same in the vector and scalar paths.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .halfs import TARGET_FEATURES, f32, widen
from .qtypes import ROWS  # rows per vector (one zmm of int32 or float32 lanes) and per block

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_HAS_BW = "+avx512bw" in TARGET_FEATURES  # the target numba compiles for (halfs)
_HAS_VNNI = _HAS_BW and "+avx512vnni" in TARGET_FEATURES
_HAS_AVX2 = "+avx2" in TARGET_FEATURES  # without AVX-512: vpmaddubsw / vpmaddwd on 256-bit halves
I8_SHIFT = 128.0  # int8 codes s enter the products as s + 128 (vpdpbusd multiplies unsigned by signed)


def _ptr(context, builder, arrty, arr, inds):
    """Address of arr[i, j] (no wraparound, no bounds check: the callers index in range)."""
    a = context.make_array(arrty)(context, builder, arr)
    inds = [context.cast(builder, v, t, types.intp) for v, t in inds]
    return cgutils.get_item_pointer2(context, builder, data=a.data, shape=cgutils.unpack_tuple(builder, a.shape),
                                     strides=cgutils.unpack_tuple(builder, a.strides), layout=arrty.layout,
                                     inds=inds, wraparound=False, boundscheck=False)


def _vec_ptr(context, builder, arrty, arr, inds, vty):
    return builder.bitcast(_ptr(context, builder, arrty, arr, inds), vty.as_pointer())


def _halves(builder, v):
    """A vector's low and high halves."""
    n = v.type.count // 2
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(h * n, h * n + n))))
            for h in range(2)]


def _join(builder, lo, hi):
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _call(builder, name, ret, args):
    fty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fty, name), args)


def _madd(builder, a, b):
    """<32 x i16> a, b -> <16 x i32>: a[2t]*b[2t] + a[2t+1]*b[2t+1] (pmaddwd)."""
    if _HAS_BW:
        return _call(builder, "llvm.x86.avx512.pmaddw.d.512", ir.VectorType(_I32, 16), [a, b])
    if _HAS_AVX2:  # two ymm pmaddwd (LLVM would otherwise widen to int32 and vpmulld)
        return _join(builder, *(_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [x, y])
                                for x, y in zip(_halves(builder, a), _halves(builder, b))))
    v32 = ir.VectorType(_I32, 16)
    even = ir.Constant(v32, list(range(0, 32, 2)))
    odd = ir.Constant(v32, list(range(1, 32, 2)))
    ext = lambda v, mask: builder.sext(builder.shuffle_vector(v, v, mask), v32)
    return builder.add(builder.mul(ext(a, even), ext(b, even)), builder.mul(ext(a, odd), ext(b, odd)))


_JIT = dict(cache=True, nogil=True, parallel=True)  # no fastmath: see the module docstring


def _load_scales(context, builder, arrty, arr, inds, n):
    """n (16, or 1 for a scalar) consecutive scales as float32: float32 ones as they are, float16
    ones (stored as uint16 bits, see qtypes) widened, which is exact (vcvtph2ps)."""
    half = arrty.dtype == types.uint16
    ety = ir.IntType(16) if half else _F32
    p = _ptr(context, builder, arrty, arr, inds)
    v = builder.load(builder.bitcast(p, (ir.VectorType(ety, n) if n > 1 else ety).as_pointer()), align=2 if half else 4)
    return widen(builder, v) if half else v


def _reduce_rows(builder, vecs, seg):
    """vecs: 16 <16 x i32> (one per row), each of segments of `seg` lanes (a sub-block's partial
    sums) -> seg vectors whose lanes are the segments' sums, in (row, segment) order."""
    while seg > 1:
        half, nxt = seg // 2, []
        for a, b in zip(vecs[0::2], vecs[1::2]):
            lo = [q * seg + i for q in range(16 // seg) for i in range(half)]
            lo = lo + [16 + i for i in lo]
            hi = [i + half for i in lo]
            mask = lambda idx: ir.Constant(ir.VectorType(_I32, 16), idx)
            nxt.append(builder.add(builder.shuffle_vector(a, b, mask(lo)), builder.shuffle_vector(a, b, mask(hi))))
        vecs, seg = nxt, half
    return vecs


def _dot4(builder, a, b, kind: str = "i8"):
    """<64 x i8> a (unsigned codes), b (signed activations) -> <16 x i32>: lane i sums
    a[4i+j] * b[4i+j] for j < 4 (vpdpbusd). Without AVX512-VNNI: widened to int16 and two
    pmaddwd, then neighbouring lanes added: the same integers (on AVX2, 4-bit codes take
    vpmaddubsw instead: _dot4_avx2)."""
    v32 = ir.VectorType(_I32, 16)
    if _HAS_VNNI:
        fty = ir.FunctionType(v32, [v32] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [ir.Constant(v32, [0] * 16), builder.bitcast(a, v32), builder.bitcast(b, v32)])
    if _HAS_AVX2 and not _HAS_BW and kind == "nib":  # 5-bit and int8 codes: the pmaddwd path measured faster
        return _join(builder, *(_dot4_avx2(builder, x, y) for x, y in zip(_halves(builder, a), _halves(builder, b))))
    v16 = ir.VectorType(_I16, 32)
    halves = []
    for h in range(2):
        idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        halves.append(_madd(builder, builder.zext(builder.shuffle_vector(a, a, idx), v16),
                            builder.sext(builder.shuffle_vector(b, b, idx), v16)))
    even = [2 * i for i in range(8)] + [16 + 2 * i for i in range(8)]
    odd = [i + 1 for i in even]
    return builder.add(builder.shuffle_vector(halves[0], halves[1], ir.Constant(v32, even)),
                       builder.shuffle_vector(halves[0], halves[1], ir.Constant(v32, odd)))


def _dot4_avx2(builder, a, b):
    """<32 x i8> -> <8 x i32>, as _dot4, for 4-bit codes (0..15): vpmaddubsw, whose int16 pair
    sums cannot saturate here (2 * 15 * 127 < 2**15), then vpmaddwd by 1. (Codes that arrive as
    s + 128 would need the offset taken out and added back: slower than the pmaddwd path.)"""
    v16, v32 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [a, b])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", v32, [pairs, ir.Constant(v16, [1] * 16)])


def _by_subblock(builder, red, sub):
    """_reduce_rows' output for one 64-weight group, lanes in (row, sub-block) order -> one
    <16 x i32> per sub-block (64 // sub of them), lanes = the 16 rows."""
    n = 64 // sub
    out = []
    for e in range(n):
        parts = []
        for a, b in zip(red[0::2], red[1::2]):  # each pair of vectors covers 32 // n rows
            idx = [r * n + e for r in range(16 // n)]
            parts.append(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx) * 2),
                                                                  idx + [16 + i for i in idx])))
        while len(parts) > 1:  # join halves: 8 + 8 lanes
            w = parts[0].type.count
            parts = [builder.shuffle_vector(parts[i], parts[i + 1], ir.Constant(ir.VectorType(_I32, 2 * w),
                                                                                list(range(2 * w))))
                     for i in range(0, len(parts), 2)]
        out.append(parts[0])
    return out


def _fifth_bits(context, builder, arrty, qs, inds, codes, offset):
    """A "nib5" row's 64 nibble codes with their fifth bits (the 8 bytes after the 32 of
    nibbles, bit j = weight j) or-ed in, plus `offset`."""
    v64 = ir.VectorType(_I8, 64)
    bits = builder.load(_vec_ptr(context, builder, arrty, qs, inds + [(context.get_constant(types.intp, 32),
                                                                        types.intp)], ir.IntType(64)), align=1)
    mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 64))
    return builder.or_(codes, builder.select(mask, ir.Constant(v64, [16 + offset] * 64),
                                             ir.Constant(v64, [offset] * 64)))


@intrinsic
def _unpack5(typingctx, qs, rb, buf):
    """Block rb of "nib5" codes (40 bytes per row and group) -> buf[0] as int8 codes (64 per
    row and group), a vector load, two shifts and a select per row: the scalar loop this
    replaces cost more than the products of 8 tokens (measured on AVX2)."""
    sig = types.none(qs, rb, buf)

    def codegen(context, builder, sig, args):
        qs_v, rb_v, buf_v = args
        ip = types.intp
        cst = lambda v: context.get_constant(ip, v)
        rb = context.cast(builder, rb_v, sig.args[1], ip)
        n_groups = cgutils.unpack_tuple(builder, context.make_array(sig.args[0])(context, builder, qs_v).shape)[1]
        v8, v64 = ir.VectorType(_I8, 32), ir.VectorType(_I8, 64)
        with cgutils.for_range(builder, n_groups) as loop:
            g = loop.index
            for i in range(ROWS):
                inds = [(rb, ip), (g, ip), (cst(i), ip)]
                b = builder.load(_vec_ptr(context, builder, sig.args[0], qs_v, inds + [(cst(0), ip)], v8), align=1)
                lo = builder.and_(b, ir.Constant(v8, [15] * 32))
                hi = builder.lshr(b, ir.Constant(v8, [4] * 32))
                codes = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
                codes = _fifth_bits(context, builder, sig.args[0], qs_v, inds, codes, 0)
                builder.store(codes, _vec_ptr(context, builder, sig.args[2], buf_v,
                                              [(cst(0), ip), (g, ip), (cst(i), ip), (cst(0), ip)], v64), align=1)
        return context.get_dummy_value()

    return sig, codegen


def _make_group(kind, sub, has_m, n_tok):
    """An intrinsic group(qs, rb, g, xq, t, d, m, c, xd, xs, y, rq): weights g*64..g*64+63 of
    the rows of block rb (their codes in qs's block rq) against tokens t..t+n_tok-1, added into
    y[t', 16rb:16rb+16] sub-block by sub-block. Each row's 64 codes are one vector of bytes
    (4-bit ones unpacked: low nibbles, then high; 5-bit ones with their bit plane), multiplied
    with a token's 64 int8 activations by one vpdpbusd; with 2 tokens the codes are loaded and
    unpacked once for both."""

    @intrinsic
    def group(typingctx, qs, rb, g, xq, t, d, m, c, xd, xs, y, rq):
        sig = types.none(qs, rb, g, xq, t, d, m, c, xd, xs, y, rq)

        def codegen(context, builder, sig, args):
            qs_v, rb_v, g_v, xq_v, t_v, d_v, m_v, c_v, xd_v, xs_v, y_v, rq_v = args
            ta = sig.args
            ip = types.intp
            cst = lambda v: context.get_constant(ip, v)
            rb = context.cast(builder, rb_v, ta[1], ip)
            rq = context.cast(builder, rq_v, ta[11], ip)  # the block of qs (rb's, or 0 of a scratch copy)
            g = context.cast(builder, g_v, ta[2], ip)
            t0 = context.cast(builder, t_v, ta[4], ip)
            toks = [builder.add(t0, cst(u)) for u in range(n_tok)]
            vf = ir.VectorType(_F32, ROWS)
            v64 = ir.VectorType(_I8, 64)
            col = builder.mul(g, cst(64))
            xvs = [builder.load(_vec_ptr(context, builder, ta[3], xq_v, [(tu, ip), (col, ip)], v64), align=1)
                   for tu in toks]
            parts = [[] for _ in toks]
            for i in range(ROWS):
                if kind == "i8":  # signed codes s as unsigned s + 128 (c moves down by 128: I8_SHIFT)
                    codes = builder.load(_vec_ptr(context, builder, ta[0], qs_v,
                                                  [(rq, ip), (g, ip), (cst(i), ip), (cst(0), ip)], v64), align=1)
                    codes = builder.xor(codes, ir.Constant(v64, [0x80] * 64))
                else:
                    v8 = ir.VectorType(_I8, 32)
                    b = builder.load(_vec_ptr(context, builder, ta[0], qs_v,
                                              [(rq, ip), (g, ip), (cst(i), ip), (cst(0), ip)], v8), align=1)
                    lo = builder.and_(b, ir.Constant(v8, [15] * 32))
                    hi = builder.lshr(b, ir.Constant(v8, [4] * 32))
                    codes = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
                    if kind == "nib5":  # + 128, as the i8 path takes the same codes unpacked (see dot_nib5_32)
                        codes = _fifth_bits(context, builder, ta[0], qs_v, [(rq, ip), (g, ip), (cst(i), ip)],
                                            codes, 128)
                for u, xv in enumerate(xvs):
                    parts[u].append(_dot4(builder, codes, xv, kind))
            per = 64 // sub  # sub-blocks per group
            sums = [list(zip(range(per), _by_subblock(builder, _reduce_rows(builder, p, 16 // per), sub)))
                    for p in parts]
            sums = [[(builder.add(builder.mul(g, cst(per)), cst(e)), v) for e, v in s] for s in sums]

            def splat(x):
                v = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(_I32, 0))
                return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, ROWS), [0] * ROWS))

            cv = context.cast(builder, c_v, ta[7], types.float32)
            if kind in ("i8", "nib5"):
                cv = builder.fsub(cv, ir.Constant(_F32, I8_SHIFT))
            cv = splat(cv)
            for tu, tok_sums in zip(toks, sums):
                py = _vec_ptr(context, builder, ta[10], y_v, [(tu, ip), (builder.mul(rb, cst(ROWS)), ip)], vf)
                yv = builder.load(py, align=4)
                for k, s in tok_sums:
                    dv = _load_scales(context, builder, ta[5], d_v, [(rb, ip), (k, ip), (cst(0), ip)], ROWS)
                    if has_m:
                        mv = _load_scales(context, builder, ta[6], m_v, [(rb, ip), (k, ip), (cst(0), ip)], ROWS)
                    else:
                        mv = splat(_load_scales(context, builder, ta[6], m_v, [(cst(0), ip), (k, ip), (cst(0), ip)], 1))
                    xk = k if sub == 32 else builder.udiv(k, cst(2))  # the activation scale covers 32 weights
                    xdv = splat(builder.load(_ptr(context, builder, ta[8], xd_v, [(tu, ip), (xk, ip)])))
                    xsv = splat(builder.load(_ptr(context, builder, ta[9], xs_v, [(tu, ip), (k, ip)])))
                    a = builder.fmul(builder.fmul(dv, xdv), builder.sitofp(s, vf))
                    b = builder.fmul(builder.fadd(mv, builder.fmul(cv, dv)), xsv)
                    yv = builder.fadd(yv, builder.fadd(a, b))
                builder.store(yv, py, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return group


_G = {(kind, sub, has_m, n): _make_group(kind, sub, has_m, n)
      for kind, sub in (("nib", 32), ("nib", 16), ("i8", 32), ("i8", 16), ("nib5", 32))
      for has_m in (False, True) for n in (1, 2)}
_nib32, _nib32m, _nib32_2, _nib32m_2 = (_G[("nib", 32, hm, n)] for n in (1, 2) for hm in (False, True))
_nib16, _nib16m, _nib16_2, _nib16m_2 = (_G[("nib", 16, hm, n)] for n in (1, 2) for hm in (False, True))
_i8_32, _i8_32m, _i8_32_2, _i8_32m_2 = (_G[("i8", 32, hm, n)] for n in (1, 2) for hm in (False, True))
_i8_16, _i8_16m, _i8_16_2, _i8_16m_2 = (_G[("i8", 16, hm, n)] for n in (1, 2) for hm in (False, True))
_nib5, _nib5m, _nib5_2, _nib5m_2 = (_G[("nib5", 32, hm, n)] for n in (1, 2) for hm in (False, True))


# The scalar loops (rows past the last whole 16) keep constant trip counts and several
# independent sums on purpose: LLVM vectorizes them whole; the int32 casts keep the sums narrow
# (numba widens integer arithmetic to int64 otherwise).

@numba.njit(inline="always", cache=True, nogil=True)
def _term(d, m, ms, c, r, k, xdv, s, xsv):
    """Sub-block k's share of row r's dot product, as the vector update computes it."""
    dk = f32(d[r >> 4, k, r & 15])
    return dk * xdv * np.float32(s) + (f32(m[(r >> 4) * ms, k, (r & 15) * ms]) + c * dk) * xsv


@numba.njit(inline="always", cache=True, nogil=True)
def _sums16(acc, d, m, ms, c, r, k, xd0, xd1, xs, t, s0, s1, s2, s3):
    """Four 16-weight sub-blocks k..k+3 (the first two under activation scale xd0), one at a time."""
    acc = acc + _term(d, m, ms, c, r, k, xd0, s0, xs[t, k])
    acc = acc + _term(d, m, ms, c, r, k + 1, xd0, s1, xs[t, k + 1])
    acc = acc + _term(d, m, ms, c, r, k + 2, xd1, s2, xs[t, k + 2])
    return acc + _term(d, m, ms, c, r, k + 3, xd1, s3, xs[t, k + 3])


@numba.njit(inline="always", cache=True, nogil=True)
def _row_nib32(qs, d, m, ms, c, xq, xd, xs, r, t):
    acc = np.float32(0.0)
    q = qs[r >> 4, :, r & 15]  # (groups, 32)
    for g in range(q.shape[0]):  # 64 weights: low nibbles, then high nibbles
        s0 = np.int32(0)
        s1 = np.int32(0)
        for j in range(32):
            b = q[g, j]
            s0 = np.int32(s0 + np.int32(np.int16(b & 15)) * np.int32(xq[t, g * 64 + j]))
            s1 = np.int32(s1 + np.int32(np.int16(b >> 4)) * np.int32(xq[t, g * 64 + 32 + j]))
        k = 2 * g
        acc = acc + _term(d, m, ms, c, r, k, xd[t, k], s0, xs[t, k])
        acc = acc + _term(d, m, ms, c, r, k + 1, xd[t, k + 1], s1, xs[t, k + 1])
    return acc


@numba.njit(inline="always", cache=True, nogil=True)
def _row_nib5_32(qs, d, m, ms, c, xq, xd, xs, r, t):
    acc = np.float32(0.0)
    q = qs[r >> 4, :, r & 15]  # (groups, 40): nibbles, then the fifth bits
    for g in range(q.shape[0]):
        s0 = np.int32(0)
        s1 = np.int32(0)
        for j in range(32):
            b = q[g, j]
            lo = np.int32(b & 15) | (np.int32((q[g, 32 + (j >> 3)] >> (j & 7)) & 1) << 4)
            hi = np.int32(b >> 4) | (np.int32((q[g, 36 + (j >> 3)] >> (j & 7)) & 1) << 4)
            s0 = np.int32(s0 + lo * np.int32(xq[t, g * 64 + j]))
            s1 = np.int32(s1 + hi * np.int32(xq[t, g * 64 + 32 + j]))
        k = 2 * g
        acc = acc + _term(d, m, ms, c, r, k, xd[t, k], s0, xs[t, k])
        acc = acc + _term(d, m, ms, c, r, k + 1, xd[t, k + 1], s1, xs[t, k + 1])
    return acc


@numba.njit(inline="always", cache=True, nogil=True)
def _row_nib16(qs, d, m, ms, c, xq, xd, xs, r, t):
    acc = np.float32(0.0)
    q = qs[r >> 4, :, r & 15]  # (groups, 32)
    for g in range(q.shape[0]):
        o = g * 32
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        for j in range(16):  # sub-blocks 4g..4g+3: low nibbles of 2 x 16 bytes, then high
            b0 = q[g, j]
            b1 = q[g, 16 + j]
            s0 = np.int32(s0 + np.int32(np.int16(b0 & 15)) * np.int32(xq[t, 2 * o + j]))
            s1 = np.int32(s1 + np.int32(np.int16(b1 & 15)) * np.int32(xq[t, 2 * o + 16 + j]))
            s2 = np.int32(s2 + np.int32(np.int16(b0 >> 4)) * np.int32(xq[t, 2 * o + 32 + j]))
            s3 = np.int32(s3 + np.int32(np.int16(b1 >> 4)) * np.int32(xq[t, 2 * o + 48 + j]))
        acc = _sums16(acc, d, m, ms, c, r, 4 * g, xd[t, 2 * g], xd[t, 2 * g + 1], xs, t, s0, s1, s2, s3)
    return acc


@numba.njit(inline="always", cache=True, nogil=True)
def _row_i8_32(qs, d, m, ms, c, xq, xd, xs, r, t):
    acc = np.float32(0.0)
    c = c - np.float32(I8_SHIFT)  # codes as unsigned, as the vector path takes them
    q = qs[r >> 4, :, r & 15]  # (groups, 64)
    for g in range(q.shape[0]):
        o = g * 64
        s0 = np.int32(0)
        s1 = np.int32(0)
        for j in range(32):
            s0 = np.int32(s0 + (np.int32(q[g, j]) + np.int32(128)) * np.int32(xq[t, o + j]))
            s1 = np.int32(s1 + (np.int32(q[g, 32 + j]) + np.int32(128)) * np.int32(xq[t, o + 32 + j]))
        k = 2 * g
        acc = acc + _term(d, m, ms, c, r, k, xd[t, k], s0, xs[t, k])
        acc = acc + _term(d, m, ms, c, r, k + 1, xd[t, k + 1], s1, xs[t, k + 1])
    return acc


@numba.njit(inline="always", cache=True, nogil=True)
def _row_i8_16(qs, d, m, ms, c, xq, xd, xs, r, t):
    acc = np.float32(0.0)
    c = c - np.float32(I8_SHIFT)  # codes as unsigned, as the vector path takes them
    q = qs[r >> 4, :, r & 15]  # (groups, 64)
    for g in range(q.shape[0]):
        o = g * 64
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        for j in range(16):
            s0 = np.int32(s0 + (np.int32(q[g, j]) + np.int32(128)) * np.int32(xq[t, o + j]))
            s1 = np.int32(s1 + (np.int32(q[g, 16 + j]) + np.int32(128)) * np.int32(xq[t, o + 16 + j]))
            s2 = np.int32(s2 + (np.int32(q[g, 32 + j]) + np.int32(128)) * np.int32(xq[t, o + 32 + j]))
            s3 = np.int32(s3 + (np.int32(q[g, 48 + j]) + np.int32(128)) * np.int32(xq[t, o + 48 + j]))
        acc = _sums16(acc, d, m, ms, c, r, 4 * g, xd[t, 2 * g], xd[t, 2 * g + 1], xs, t, s0, s1, s2, s3)
    return acc


# The kernels: qs, d, m, ms, c in qtypes' blocked layout; xq, xd, xs from quantize.quantize_x
# -> y (n_tok, n_rows). Task rb < n_rows // 16 takes block rb through the vector groups; the
# last, the rows of a partial block. One kernel per family, alike on purpose: a single kernel
# choosing the family's intrinsics at run time measured 4-13% slower at 16-128 tokens.

@numba.njit(**_JIT)
def dot_nib32(qs, d, m, ms, c, xq, xd, xs, y):
    """4-bit codes, a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nib32(qs, d, m, ms, c, xq, xd, xs, r, t)
            continue
        for t in range(0, n_tok, 2):  # tokens in pairs: one load and unpack of the codes for two
            y[t, rb * ROWS:rb * ROWS + ROWS] = 0
            if t + 1 < n_tok:
                y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 1 < n_tok:
                    if ms:
                        _nib32m_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                    else:
                        _nib32_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                elif ms:
                    _nib32m(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                else:
                    _nib32(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)


UNPACK_MIN_TOKENS = 4  # above this, unpacking a block of 5-bit codes once beats unpacking them per pair


@numba.njit(**_JIT)
def dot_nib5_32(qs, d, m, ms, c, xq, xd, xs, y):
    """5-bit codes (4-bit nibbles and a bit plane), a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nib5_32(qs, d, m, ms, c, xq, xd, xs, r, t)
            continue
        if n_tok > UNPACK_MIN_TOKENS:  # many tokens: the block unpacked once to int8, the i8 path on it
            buf = np.empty((1, qs.shape[1], ROWS, 64), np.int8)
            _unpack5(qs, rb, buf)
            for t in range(0, n_tok, 2):
                y[t, rb * ROWS:rb * ROWS + ROWS] = 0
                if t + 1 < n_tok:
                    y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
                for g in range(qs.shape[1]):
                    if t + 1 < n_tok:
                        if ms:
                            _i8_32m_2(buf, rb, g, xq, t, d, m, c, xd, xs, y, 0)
                        else:
                            _i8_32_2(buf, rb, g, xq, t, d, m, c, xd, xs, y, 0)
                    elif ms:
                        _i8_32m(buf, rb, g, xq, t, d, m, c, xd, xs, y, 0)
                    else:
                        _i8_32(buf, rb, g, xq, t, d, m, c, xd, xs, y, 0)
            continue
        for t in range(0, n_tok, 2):  # tokens in pairs: one load and unpack of the codes for two
            y[t, rb * ROWS:rb * ROWS + ROWS] = 0
            if t + 1 < n_tok:
                y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 1 < n_tok:
                    if ms:
                        _nib5m_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                    else:
                        _nib5_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                elif ms:
                    _nib5m(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                else:
                    _nib5(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_nib16(qs, d, m, ms, c, xq, xd, xs, y):
    """4-bit codes, a scale per 16 (Q2_K, Q3_K)."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nib16(qs, d, m, ms, c, xq, xd, xs, r, t)
            continue
        for t in range(0, n_tok, 2):  # tokens in pairs: one load and unpack of the codes for two
            y[t, rb * ROWS:rb * ROWS + ROWS] = 0
            if t + 1 < n_tok:
                y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 1 < n_tok:
                    if ms:
                        _nib16m_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                    else:
                        _nib16_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                elif ms:
                    _nib16m(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                else:
                    _nib16(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_i8_32(qs, d, m, ms, c, xq, xd, xs, y):
    """int8 codes, a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_i8_32(qs, d, m, ms, c, xq, xd, xs, r, t)
            continue
        for t in range(0, n_tok, 2):  # tokens in pairs: one load and unpack of the codes for two
            y[t, rb * ROWS:rb * ROWS + ROWS] = 0
            if t + 1 < n_tok:
                y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 1 < n_tok:
                    if ms:
                        _i8_32m_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                    else:
                        _i8_32_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                elif ms:
                    _i8_32m(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                else:
                    _i8_32(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_i8_16(qs, d, m, ms, c, xq, xd, xs, y):
    """int8 codes, a scale per 16 (Q6_K)."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_i8_16(qs, d, m, ms, c, xq, xd, xs, r, t)
            continue
        for t in range(0, n_tok, 2):  # tokens in pairs: one load and unpack of the codes for two
            y[t, rb * ROWS:rb * ROWS + ROWS] = 0
            if t + 1 < n_tok:
                y[t + 1, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 1 < n_tok:
                    if ms:
                        _i8_16m_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                    else:
                        _i8_16_2(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                elif ms:
                    _i8_16m(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)
                else:
                    _i8_16(qs, rb, g, xq, t, d, m, c, xd, xs, y, rb)


# The family travels as a type: a tag, an empty array whose dtype names it (TAGS[kind]), so
# that compiled callers specialize on it and only the families a model's weights use are ever
# compiled (a first run compiles them: each is seconds of LLVM). An integer `kind` would be one
# type for all four, and each caller would compile every family.
TAGS = tuple(np.empty(0, dt) for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8))  # by qtypes.KINDS


def _family(tag, qs, d, m, ms, c, xq, xd, xs, y):
    """The kernel of the family that `tag` names; compiled code only (see the overload)."""
    raise NotImplementedError


@overload(_family)
def _family_for_tag(tag, qs, d, m, ms, c, xq, xd, xs, y):
    kernel = {"int8": dot_nib32, "int16": dot_nib16, "int32": dot_i8_32, "int64": dot_i8_16,
              "uint8": dot_nib5_32}[str(tag.dtype)]

    def impl(tag, qs, d, m, ms, c, xq, xd, xs, y):
        kernel(qs, d, m, ms, c, xq, xd, xs, y)
    return impl


@numba.njit(cache=True, nogil=True)
def dot_any(tag, qs, d, m, ms, c, xq, xd, xs, y):
    """The kernel of the family `tag` names (TAGS), chosen when a caller is compiled."""
    _family(tag, qs, d, m, ms, c, xq, xd, xs, y)
