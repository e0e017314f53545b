"""Integer matmul kernels for a few to a few dozen tokens (batched decode): each weight block is
decoded once and applied to a chunk of 16 tokens at a time (or 8 or 4: few tokens, a remainder).

The activations are quantized as for dot.py (int16 codes, a scale per 32, per-sub-block sums),
then transposed so that tokens are innermost, in chunks of w: x2[ch, p, 2u + e] = xq[w*ch + u, 2p + e]
holds, for weight pair p, the pair's two codes of the chunk's w tokens side by side. A weight pair (c0, c1), broadcast as one
32-bit lane, then multiplies 16 tokens' pairs in a single vpmaddwd / vpdpwssd:
lane t += c0*x[2p, t] + c1*x[2p+1, t]. With w = 8 (4) one vector holds 2 (4) consecutive pairs'
rows of x2 against those pairs broadcast to 8 (4) lanes each, and the partial sums of a token are
added at the end. No horizontal sums within a chunk's pair, and the int32 sums are exact.

numba's loops do not get there by themselves (loop-carried accumulators stay in memory and
may alias the inputs), so the sub-block sums and the float combination are small LLVM-IR
intrinsics: straight-line code over <16 x i32> / <16 x float> values, generic IR that any
target can lower, plus the AVX-512BW pmaddwd intrinsic where the host has it (LLVM then fuses
its add into vpdpwssd with VNNI).

Batch invariance: the float combination of a sub-block k for token t is
    y = y + ((d[r, k] * xd[t, k*sub//32]) * float(s) + (m + c*d[r, k]) * xs[t, k])
in sub-block order (d and m column-major, see qtypes), with plain IEEE operations (no fastmath:
no reassociation, no FMA contraction), exactly what dot.py's one-token kernels compute; so y[t, r] is bitwise the same
whatever the other tokens of the call and whichever of the two kernels ran.
"""

import llvmlite.binding as llb
import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .qtypes import ROWS

W = 16  # tokens per chunk at most: 16 int32 / float32 lanes (one zmm)
# chunk widths, told to the intrinsics by the dtype of the chunk's x2 (its lane of code pairs per
# token: int16 x2 for 16 tokens, an int32 view of the same layout for 8, int64 for 4): a zmm then
# holds 16 // w weight pairs x w tokens, so a narrow chunk still fills the vector units.
WIDTHS = (16, 8, 4)
_X2_DTYPE = {16: np.int16, 8: np.int32, 4: np.int64}
_WIDTH_OF = {types.int16: 16, types.int32: 8, types.int64: 4}
ROW_BLOCK = ROWS  # rows per task (a block of qtypes' layout): one chunk of activations is applied to them all while in L1
NACC = 4  # independent accumulators per sub-block sum: hides the vpdpwssd latency

_JIT = dict(cache=True, nogil=True, parallel=True)  # no fastmath: see the module docstring
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_HAS_BW = "+avx512bw" in llb.get_host_cpu_features().flatten()


def _ptr(context, builder, arrty, arr, inds):
    """Address of arr[i, j] (no wraparound, no bounds check: the callers index in range)."""
    a = context.make_array(arrty)(context, builder, arr)
    inds = [context.cast(builder, v, t, types.intp) for v, t in inds]
    return cgutils.get_item_pointer2(context, builder, data=a.data, shape=cgutils.unpack_tuple(builder, a.shape),
                                     strides=cgutils.unpack_tuple(builder, a.strides), layout=arrty.layout,
                                     inds=inds, wraparound=False, boundscheck=False)


def _vec_ptr(context, builder, arrty, arr, inds, vty):
    return builder.bitcast(_ptr(context, builder, arrty, arr, inds), vty.as_pointer())


def _qs_ptr(context, builder, qsty, qs, r, rty, q0, q0ty, per_group, vty):
    """Address of byte q0 of row r in qtypes' blocked layout (`per_group` bytes per 64 weights):
    qs[r >> 4, q0 // per_group, r & 15, q0 % per_group]."""
    ip = types.intp
    r = context.cast(builder, r, rty, ip)
    q0 = context.cast(builder, q0, q0ty, ip)
    cst = lambda v: context.get_constant(ip, v)
    inds = [builder.lshr(r, cst(4)), builder.udiv(q0, cst(per_group)), builder.and_(r, cst(15)), builder.urem(q0, cst(per_group))]
    return _vec_ptr(context, builder, qsty, qs, [(v, ip) for v in inds], vty)


def _splat(builder, vec, e, n):
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), [e] * n))


def _madd(builder, a, b):
    """<2W x i16> a, b -> <W x i32>: a[2t]*b[2t] + a[2t+1]*b[2t+1] (pmaddwd)."""
    if _HAS_BW:
        fty = ir.FunctionType(ir.VectorType(_I32, 16), [ir.VectorType(_I16, 32)] * 2)
        fn = cgutils.get_or_insert_function(builder.module, fty, "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(fn, [a, b])
    v32 = ir.VectorType(_I32, W)
    even = ir.Constant(v32, list(range(0, 2 * W, 2)))
    odd = ir.Constant(v32, list(range(1, 2 * W, 2)))
    ext = lambda v, mask: builder.sext(builder.shuffle_vector(v, v, mask), v32)
    return builder.add(builder.mul(ext(a, even), ext(b, even)), builder.mul(ext(a, odd), ext(b, odd)))


def _make_sub_sum(n_pairs, kind):
    """An intrinsic sub_sum(qs, r, q0, x2, p0, j) -> UniTuple(int32, w): for the sub-block whose
    2*n_pairs codes sit in bytes q0:q0 + 2*n_pairs of row r (blocked, see qtypes) (kind "lo"/"hi": their low/high
    nibbles, "i8": the int8 bytes themselves), lane t = sum over i of code_i * x of that weight
    and token t of the chunk x2 (w tokens, w from its dtype), x2 rows p0.. holding the weight pairs.
    Each vpdpwssd takes g = 16 // w consecutive pairs (contiguous rows of x2) against the pair
    codes shuffled to match; the g partial sums of a token are added at the end (exact int32)."""

    @intrinsic
    def sub_sum(typingctx, qs, r, q0, x2, p0, j):
        w = _WIDTH_OF[x2.dtype]
        sig = types.UniTuple(types.int32, w)(qs, r, q0, x2, p0, j)

        def codegen(context, builder, sig, args):
            qs_v, r_v, q0_v, x2_v, p0_v, j_v = args
            ta = sig.args
            nb = 2 * n_pairs
            g = 16 // w  # pairs per vector
            v16 = ir.VectorType(_I16, nb)
            per_group = 64 if kind == "i8" else 32
            b = builder.load(_qs_ptr(context, builder, ta[0], qs_v, r_v, ta[1], q0_v, ta[2], per_group, ir.VectorType(_I8, nb)), align=1)
            if kind == "i8":
                codes = builder.sext(b, v16)
            elif kind == "lo":
                codes = builder.and_(builder.zext(b, v16), ir.Constant(v16, [15] * nb))
            else:
                codes = builder.lshr(builder.zext(b, v16), ir.Constant(v16, [4] * nb))
            pairs = builder.bitcast(codes, ir.VectorType(_I32, n_pairs))  # lane p: codes 2p, 2p+1
            x_row = builder.extract_value(context.make_array(ta[3])(context, builder, x2_v).strides, 0)
            px = builder.bitcast(_ptr(context, builder, ta[3], x2_v, [(p0_v, ta[4]), (j_v, ta[5])]), _I8.as_pointer())
            vx = ir.VectorType(_I16, 32)
            v32 = ir.VectorType(_I32, 16)
            accs = [ir.Constant(v32, [0] * 16)] * NACC
            for q in range(n_pairs // g):
                xp = builder.gep(px, [builder.mul(x_row, ir.Constant(x_row.type, q * g))])
                xv = builder.load(builder.bitcast(xp, vx.as_pointer()), align=2)
                mask = ir.Constant(v32, [q * g + i // w for i in range(16)])
                cp = builder.bitcast(builder.shuffle_vector(pairs, pairs, mask), vx)
                accs[q % NACC] = builder.add(accs[q % NACC], _madd(builder, xv, cp))
            acc = accs[0]
            for a in accs[1:]:
                acc = builder.add(acc, a)
            vw = ir.VectorType(_I32, w)
            part = lambda h: builder.shuffle_vector(acc, acc, ir.Constant(vw, [h * w + i for i in range(w)]))
            tot = part(0)
            for h in range(1, g):
                tot = builder.add(tot, part(h))
            out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
            for e in range(w):
                out = builder.insert_value(out, builder.extract_element(tot, ir.Constant(_I32, e)), e)
            return out

        return sig, codegen

    return sub_sum


_lo16, _hi16, _i8_16 = (_make_sub_sum(16, k) for k in ("lo", "hi", "i8"))  # 32-weight sub-blocks
_lo8, _hi8, _i8_8 = (_make_sub_sum(8, k) for k in ("lo", "hi", "i8"))  # 16-weight sub-blocks


@intrinsic
def _combine(typingctx, yT, r, t0, s, dk, xdc, kx, xsc, k, off):
    """yT[r, t0+t] = yT[r, t0+t] + ((dk * xdc[kx, t]) * float(s[t]) + off * xsc[k, t]), t < w = len(s)."""
    sig = types.none(yT, r, t0, s, dk, xdc, kx, xsc, k, off)
    w = s.count

    def codegen(context, builder, sig, args):
        y_v, r_v, t_v, s_v, dk_v, xd_v, kx_v, xs_v, k_v, off_v = args
        ta = sig.args
        vf = ir.VectorType(_F32, w)

        def splat(x, ty):
            x = context.cast(builder, x, ty, types.float32)
            v = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(_I32, 0))
            return _splat(builder, v, 0, w)

        py = _vec_ptr(context, builder, ta[0], y_v, [(r_v, ta[1]), (t_v, ta[2])], vf)
        zero = context.get_constant(types.intp, 0)
        pd = _vec_ptr(context, builder, ta[5], xd_v, [(kx_v, ta[6]), (zero, types.intp)], vf)
        ps = _vec_ptr(context, builder, ta[7], xs_v, [(k_v, ta[8]), (zero, types.intp)], vf)
        sv = ir.Constant(ir.VectorType(_I32, w), ir.Undefined)
        for e in range(w):
            sv = builder.insert_element(sv, builder.extract_value(s_v, e), ir.Constant(_I32, e))
        a = builder.fmul(builder.fmul(splat(dk_v, ta[4]), builder.load(pd, align=4)), builder.sitofp(sv, vf))
        b = builder.fmul(splat(off_v, ta[9]), builder.load(ps, align=4))
        builder.store(builder.fadd(builder.load(py, align=4), builder.fadd(a, b)), py, align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always", cache=True, nogil=True)
def _term(tile, i, r, s, d, m, ms, c, k, xdc, kx, xsc):
    """Sub-block k of row r (the tile's row i) for the chunk's tokens."""
    dk = d[r >> 4, k, r & 15]
    _combine(tile, i, 0, s, dk, xdc, kx, xsc, k, m[(r >> 4) * ms, k, (r & 15) * ms] + c * dk)


@numba.njit(inline="always", cache=True, nogil=True)
def _zero(tile, i, w):
    for t in range(w):
        tile[i, t] = np.float32(0.0)


@numba.njit(inline="always", cache=True, nogil=True)
def _store(tile, y, r0, r1, t0):
    """The tile (rows r0..r1-1 x tokens t0..) into y (n_tok, n_rows), padding tokens dropped."""
    for u in range(min(tile.shape[1], y.shape[0] - t0)):
        for i in range(r1 - r0):
            y[t0 + u, r0 + i] = tile[i, u]


@numba.njit(**_JIT)
def mt_nib32(qs, d, m, ms, c, x2, xdT, xsT, y, tb):
    """4-bit codes, a scale per 32 (qtypes' blocked layout) -> y (n_tok, n_rows): the segment's
    tokens tb.., a tile of a block's rows x a chunk's tokens at a time."""
    w = xdT.shape[2]
    for rb in prange(qs.shape[0]):
        tile = np.empty((ROW_BLOCK, w), np.float32)  # the block's rows x one chunk's tokens
        r0, r1 = rb * ROW_BLOCK, min(rb * ROW_BLOCK + ROW_BLOCK, y.shape[1])
        for ch in range(x2.shape[0]):
            xc, xdc, xsc, t0 = x2[ch], xdT[ch], xsT[ch], tb + ch * w
            for r in range(r0, r1):
                i = r - r0
                _zero(tile, i, w)
                for g in range(qs.shape[1]):  # 64 weights: low nibbles, then high nibbles
                    o = g * 32
                    s0 = _lo16(qs, r, o, xc, o, 0)
                    s1 = _hi16(qs, r, o, xc, o + 16, 0)
                    _term(tile, i, r, s0, d, m, ms, c, 2 * g, xdc, 2 * g, xsc)
                    _term(tile, i, r, s1, d, m, ms, c, 2 * g + 1, xdc, 2 * g + 1, xsc)
            _store(tile, y, r0, r1, t0)


@numba.njit(**_JIT)
def mt_nib16(qs, d, m, ms, c, x2, xdT, xsT, y, tb):
    """4-bit codes, a scale per 16 (Q2_K, Q3_K)."""
    w = xdT.shape[2]
    for rb in prange(qs.shape[0]):
        tile = np.empty((ROW_BLOCK, w), np.float32)  # the block's rows x one chunk's tokens
        r0, r1 = rb * ROW_BLOCK, min(rb * ROW_BLOCK + ROW_BLOCK, y.shape[1])
        for ch in range(x2.shape[0]):
            xc, xdc, xsc, t0 = x2[ch], xdT[ch], xsT[ch], tb + ch * w
            for r in range(r0, r1):
                i = r - r0
                _zero(tile, i, w)
                for g in range(qs.shape[1]):  # sub-blocks 4g..4g+3: low nibbles of 2 x 16 bytes, then high
                    o = g * 32
                    s0 = _lo8(qs, r, o, xc, o, 0)
                    s1 = _lo8(qs, r, o + 16, xc, o + 8, 0)
                    s2 = _hi8(qs, r, o, xc, o + 16, 0)
                    s3 = _hi8(qs, r, o + 16, xc, o + 24, 0)
                    k = 4 * g
                    _term(tile, i, r, s0, d, m, ms, c, k, xdc, 2 * g, xsc)
                    _term(tile, i, r, s1, d, m, ms, c, k + 1, xdc, 2 * g, xsc)
                    _term(tile, i, r, s2, d, m, ms, c, k + 2, xdc, 2 * g + 1, xsc)
                    _term(tile, i, r, s3, d, m, ms, c, k + 3, xdc, 2 * g + 1, xsc)
            _store(tile, y, r0, r1, t0)


@numba.njit(**_JIT)
def mt_i8_32(qs, d, m, ms, c, x2, xdT, xsT, y, tb):
    """int8 codes, a scale per 32."""
    w = xdT.shape[2]
    for rb in prange(qs.shape[0]):
        tile = np.empty((ROW_BLOCK, w), np.float32)  # the block's rows x one chunk's tokens
        r0, r1 = rb * ROW_BLOCK, min(rb * ROW_BLOCK + ROW_BLOCK, y.shape[1])
        for ch in range(x2.shape[0]):
            xc, xdc, xsc, t0 = x2[ch], xdT[ch], xsT[ch], tb + ch * w
            for r in range(r0, r1):
                i = r - r0
                _zero(tile, i, w)
                for g in range(qs.shape[1]):
                    o = g * 64
                    s0 = _i8_16(qs, r, o, xc, o // 2, 0)
                    s1 = _i8_16(qs, r, o + 32, xc, o // 2 + 16, 0)
                    _term(tile, i, r, s0, d, m, ms, c, 2 * g, xdc, 2 * g, xsc)
                    _term(tile, i, r, s1, d, m, ms, c, 2 * g + 1, xdc, 2 * g + 1, xsc)
            _store(tile, y, r0, r1, t0)


@numba.njit(**_JIT)
def mt_i8_16(qs, d, m, ms, c, x2, xdT, xsT, y, tb):
    """int8 codes, a scale per 16 (Q6_K)."""
    w = xdT.shape[2]
    for rb in prange(qs.shape[0]):
        tile = np.empty((ROW_BLOCK, w), np.float32)  # the block's rows x one chunk's tokens
        r0, r1 = rb * ROW_BLOCK, min(rb * ROW_BLOCK + ROW_BLOCK, y.shape[1])
        for ch in range(x2.shape[0]):
            xc, xdc, xsc, t0 = x2[ch], xdT[ch], xsT[ch], tb + ch * w
            for r in range(r0, r1):
                i = r - r0
                _zero(tile, i, w)
                for g in range(qs.shape[1]):
                    o = g * 64
                    s0 = _i8_8(qs, r, o, xc, o // 2, 0)
                    s1 = _i8_8(qs, r, o + 16, xc, o // 2 + 8, 0)
                    s2 = _i8_8(qs, r, o + 32, xc, o // 2 + 16, 0)
                    s3 = _i8_8(qs, r, o + 48, xc, o // 2 + 24, 0)
                    k = 4 * g
                    _term(tile, i, r, s0, d, m, ms, c, k, xdc, 2 * g, xsc)
                    _term(tile, i, r, s1, d, m, ms, c, k + 1, xdc, 2 * g, xsc)
                    _term(tile, i, r, s2, d, m, ms, c, k + 2, xdc, 2 * g + 1, xsc)
                    _term(tile, i, r, s3, d, m, ms, c, k + 3, xdc, 2 * g + 1, xsc)
            _store(tile, y, r0, r1, t0)


@numba.njit(cache=True, nogil=True)
def _transpose_x(xq, xd, xs, t_first, x2, xdT, xsT):
    """Tokens t_first.. in chunks of w = xdT.shape[2], tokens innermost, padding tokens zero: for
    t = t_first + ch*w + u, x2[ch, p, 2u+e] = xq[t, 2p+e], xdT[ch, k, u] = xd[t, k], xsT[ch, k, u] = xs[t, k]."""
    w = xdT.shape[2]
    x2[:] = 0
    xdT[:] = 0
    xsT[:] = 0
    for t in range(t_first, min(xq.shape[0], t_first + x2.shape[0] * w)):
        ch, u = (t - t_first) // w, (t - t_first) % w
        for p in range(x2.shape[1]):
            x2[ch, p, 2 * u] = xq[t, 2 * p]
            x2[ch, p, 2 * u + 1] = xq[t, 2 * p + 1]
        for k in range(xdT.shape[1]):
            xdT[ch, k, u] = xd[t, k]
        for k in range(xsT.shape[1]):
            xsT[ch, k, u] = xs[t, k]


KERNELS = {("nib", 32): mt_nib32, ("nib", 16): mt_nib16, ("i8", 32): mt_i8_32, ("i8", 16): mt_i8_16}


def chunk_plan(n_tok):
    """[(w, n_chunks), ...] covering n_tok tokens: one 4- or 8-token chunk up to 8 tokens,
    16-token ones beyond, a remainder of up to 8 in one 4- or 8-token chunk (a chunk costs about
    in proportion to its width; each segment is one more pass over the weights)."""
    n16, rest = divmod(n_tok, 16) if n_tok > 8 else (0, n_tok)
    if rest > 8:
        return [(16, n16 + 1)]
    tail = [] if rest == 0 else [(4, 1)] if rest <= 4 else [(8, 1)]
    return ([(16, n16)] if n16 else []) + tail


def prepare_x(xq, xd, xs):
    """Quantized x (xq (n_tok, n_pad) int16, xd, xs as kernels.quantize_x) in the kernels'
    chunk-major layout, one segment of equal-width chunks per entry of chunk_plan: one chunk's
    activations are contiguous (a row-of-pairs stride above 64 bytes would crowd the L1 sets)."""
    n_tok, n_pad = xq.shape
    segments, t_first = [], 0
    for w, n_ch in chunk_plan(n_tok):
        x2 = np.empty((n_ch, n_pad // 2, 2 * w), dtype=np.int16)
        xdT = np.empty((n_ch, xd.shape[1], w), dtype=np.float32)
        xsT = np.empty((n_ch, xs.shape[1], w), dtype=np.float32)
        _transpose_x(xq, xd, xs, t_first, x2, xdT, xsT)
        segments.append((x2.view(_X2_DTYPE[w]), xdT, xsT, t_first))
        t_first += n_ch * w
    return segments


def matmul_multi(qs, d, m, ms, c, layout, sub, prepared, y):
    """`prepared` from prepare_x -> y (n_tok, n_rows) float32, written in place."""
    kern = KERNELS[(layout, sub)]
    for x2, xdT, xsT, tb in prepared:
        kern(qs, d, m, ms, np.float32(c), x2, xdT, xsT, y, tb)
    return y
