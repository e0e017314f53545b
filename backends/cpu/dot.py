"""Integer dot products of packed weight rows with int8-quantized activations (every matmul
of the quantized types below matmul.BLAS_MIN_TOKENS tokens).

Sub-block k of a row holds weight = d*(code + c) + m; activations are x = xd*xq per 32 (int8
codes, amax/127: ggml's q8_0), and xs = xd*sum(xq) per sub-block, so the sub-block's share of
the dot product is d*xd*sum(code*xq) + (m + c*d)*xs: integers inside, one float multiply-add per
sub-block (K-quants' d and m formed first, as float32(D) * float32(sc): exact, see qtypes).
Codes go in as unsigned bytes (int8 ones as s + 128, c lower by I8_SHIFT) because vpdpbusd
multiplies unsigned by signed bytes (without AVX512-VNNI, pmaddwd or vpmaddubsw give the same
integers).

Rows go 16 at a time, interleaved 4 weights at a time (qtypes): one 64-byte load holds 4
consecutive weights of each of the 16 rows, a row a 32-bit lane, so one vpdpbusd against the
token's 4 activations broadcast to every lane adds each row's 4 products into that row's own
lane. A sub-block's sums thus build up in one vector of 16 rows, and the float update runs on
vectors of 16 rows, with no reduction across lanes (the previous layout, a row's 64 weights per
load, needed a transposing tree of shuffles per group and token that cost more than the
products: 64-token matmuls of Qwen2.5-0.5B ran 1.4-1.8x slower with it). 4-, 5- and 6-bit codes
are unpacked in registers (two nibbles a byte; the fifth bits as a 64-bit mask per load, Q6_K's
top two from 2-bit planes), once for all the tokens of a call.

Many tokens (batched decode, prefill) go through the same kernels, 8 tokens at a time (then 4,
2, 1) within each block of rows (a block's codes loaded and unpacked once for the 8, and in L1
for the next 8; on AVX2, whose 16 vector registers hold 4 tokens' sums but not 8, as two passes of
4); kinds with a scale per 16 take 4 at a time, as 8 tokens' sums of 4 sub-blocks
would not fit the 32 vector registers (measured: 8 for those was no faster, 8 instead of 4 for
the others 8-22% faster at 8-64 tokens); fewer tokens split each sub-block's sums into more
parts, so that enough independent vpdpbusd chains are in flight (one chain of 8 stalls on its
latency). On AVX2 without AVX-512, 4- and 5-bit codes at 4 or more tokens add vpmaddubsw's int16
pair sums as int16 (_ACC16) and finish each sub-block (its sums, then y) before the next: 1.1-1.5x
the products' rate at 4-16 tokens on Zen 3, the same integers. The error
of int8 activations is llama.cpp's own (q8_0 activations), ~3e-5 NMSE on random data.

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

from .halfs import TARGET_FEATURES, _call, _ptr, _vec_ptr, widen
from .qtypes import LUTS, ROWS  # ROWS: rows per vector (one zmm of int32 or float32 lanes) and per block
from .quantize import nib_code, sub_scale

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_HAS_BW = "+avx512bw" in TARGET_FEATURES  # the target numba compiles for (halfs)
_HAS_VNNI = _HAS_BW and "+avx512vnni" in TARGET_FEATURES
_HAS_AVX2 = "+avx2" in TARGET_FEATURES  # without AVX-512: vpmaddubsw / vpmaddwd on 256-bit halves
I8_SHIFT = 128.0  # int8 codes s enter the products as s + 128 (vpdpbusd multiplies unsigned by signed)
# the lookup layouts' 16 values as s + 128, and the identity for plain nibbles (the scalar tails')
_TABLES = {name: np.array(v, np.int32) + 128 for name, v in LUTS.items()}
# AVX2 without AVX-512: the signed values themselves, multiplied as vpmaddubsw(|s|, sign(x, s)), whose
# pair sums cannot saturate (|s| <= 128, |x| <= 127), where s + 128 would need the slow widening path
_SIGNED_LUT = _HAS_AVX2 and not _HAS_BW
_I8_SIGNED = _SIGNED_LUT  # int8 codes likewise (Q8_0, Q6_K, the IQ2/IQ3/IQ1 grids): signed, no shift
_I8_OFF = 0 if _I8_SIGNED else 128
_ID32 = np.arange(32, dtype=np.int32)  # 5-bit codes too
_LUT6 = np.arange(-32, 32, dtype=np.int32) + _I8_OFF  # "nib6" codes u as the "i8" kind takes s = u - 32
_NIB6_ADD = (_I8_OFF - 32) & 255  # that in registers: a byte add to u
_LUT_IQ4, _LUT_FP4 = _TABLES["iq4nl"], _TABLES["mxfp4"]
# AVX2 without AVX-512, 4- and 5-bit codes: vpmaddubsw's int16 pair sums (at most 2 * 31 * 128) are
# added as int16 this many times before one vpmaddwd widens them (8 * 2 * 15 * 128 and 4 * 2 * 31 * 128
# and Q6_K's 4 * 2 * 32 * 127 stay below 2**15), rather than a vpmaddwd and an add after each: half the multiply-port work
_ACC16 = {"nib": 8, "nib5": 4, "six": 4} if _HAS_AVX2 and not _HAS_BW else {}  # six: Q6_K's s = u - 32 as int8


def _lookup(builder, idx, table):
    """<64 x i8> nibbles (0..15) -> table[idx] as unsigned bytes: vpshufb within each 16-byte
    lane (the table repeated in every lane); a chain of selects without SSSE3."""
    v64 = ir.VectorType(_I8, 64)
    if _HAS_BW or _HAS_AVX2:
        tbl = lambda n: ir.Constant(ir.VectorType(_I8, n), [int(table[i % 16]) & 255 for i in range(n)])  # noqa: E731
        if _HAS_BW:
            return _call(builder, "llvm.x86.avx512.pshuf.b.512", v64, [tbl(64), idx])
        halves = [_call(builder, "llvm.x86.avx2.pshuf.b", ir.VectorType(_I8, 32), [tbl(32), h])
                  for h in _halves(builder, idx)]
        return _join(builder, *halves)
    out = ir.Constant(v64, [0] * 64)
    for i in range(16):
        hit = builder.icmp_unsigned("==", idx, ir.Constant(v64, [i] * 64))
        out = builder.select(hit, ir.Constant(v64, [int(table[i]) & 255] * 64), out)
    return out


def _halves(builder, v):
    """A vector's low and high halves."""
    n = v.type.count // 2
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(h * n, h * n + n))))
            for h in range(2)]


def _join(builder, lo, hi):
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


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
# Software prefetch of the codes into L2 (prefetcht1), 8 KiB ahead of the group being multiplied.
# A decode step's matvecs (0.5-3.5 MB each, then the next matrix) left the hardware prefetcher
# behind: one thread's load misses and its products took turns instead of overlapping. Measured on
# a 2-core Xeon (Sapphire Rapids class), 2 threads, weights from DRAM: Qwen2.5-0.5B's 3 MB Q5_0
# matvec 17.9 -> 21.0 GB/s, its 145 MB Q8_0 output projection 24.1 -> 29.5 (a plain read: 31), and
# its decode step 26.7 -> 22.3 ms; 4-16 KiB ahead all did about as well; into L1 (t0) a little
# worse; non-temporal (nta) halved the rate. Past an array's end it reads nothing (no fault).
PREFETCH_AHEAD = 8192
_GROUP_BYTES = {"i8": 1024, "nib5": 640, "nib6": 768}  # a group's code bytes (16 rows x 64 weights)
_GROUP_BYTES.update({k: 512 for k in ("nib", "iq4nl", "mxfp4")})


def _load_scales(context, builder, arrty, arr, inds, n):
    """n (16, or 1 for a scalar) consecutive scales as float32: float32 ones as they are, float16
    ones (stored as uint16 bits, see qtypes) widened, which is exact (vcvtph2ps), a K-quant's
    small integers (int8/uint8) converted (exact; the caller multiplies by the super-block's)."""
    dt = arrty.dtype
    ety = {types.uint16: ir.IntType(16), types.int8: _I8, types.uint8: _I8}.get(dt, _F32)
    p = _ptr(context, builder, arrty, arr, inds)
    v = builder.load(builder.bitcast(p, (ir.VectorType(ety, n) if n > 1 else ety).as_pointer()),
                     align=max(dt.bitwidth // 8, 1))
    if dt == types.uint16:
        return widen(builder, v)
    fty = ir.VectorType(_F32, n) if n > 1 else _F32
    if dt == types.int8:
        return builder.sitofp(v, fty)
    return builder.uitofp(v, fty) if dt == types.uint8 else v


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
    if _HAS_AVX2 and not _HAS_BW and kind in ("nib", "nib5"):  # int8 codes (as s + 128) would saturate it
        return _join(builder, *(_dot4_avx2(builder, x, y) for x, y in zip(_halves(builder, a), _halves(builder, b))))
    if _SIGNED_LUT and (kind in LUTS or kind == "i8" and _I8_SIGNED):  # signed values (see _SIGNED_LUT)
        return _join(builder, *(_dot4_avx2(builder, _call(builder, "llvm.abs.v32i8", x.type, [x, ir.Constant(ir.IntType(1), 0)]),
                                           _call(builder, "llvm.x86.avx2.psign.b", y.type, [y, x]))
                                for x, y in zip(_halves(builder, a), _halves(builder, b))))
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
    """<32 x i8> -> <8 x i32>, as _dot4, for 4-bit codes (0..15), or |s| of signed ones with the
    activations' signs flipped to match: vpmaddubsw, whose int16 pair sums cannot saturate here
    (2 * 127 * 127 < 2**15), then vpmaddwd by 1. (Codes that arrive as
    s + 128 would need the offset taken out and added back: slower than the pmaddwd path.)"""
    v16, v32 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [a, b])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", v32, [pairs, ir.Constant(v16, [1] * 16)])


def _dpbusd(builder, acc, a, b, kind):
    """acc + _dot4(a, b): vpdpbusd accumulating in place where there is VNNI. acc None: zero."""
    if _HAS_VNNI:
        v32 = ir.VectorType(_I32, 16)
        acc = ir.Constant(v32, [0] * 16) if acc is None else acc
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v32, [acc, builder.bitcast(a, v32), builder.bitcast(b, v32)])
    r = _dot4(builder, a, b, kind)
    return r if acc is None else builder.add(acc, r)


def _six_bits(builder, lo, hi, plane, j, bias):
    """Load j's nibble vectors of a "nib6" group (low: v = 2j, high: 2j+1) with their top two bits,
    bits 2(v % 4) of `plane` (the group's 64-byte plane j // 2, qtypes), plus bias (mod 256)."""
    v64 = ir.VectorType(_I8, 64)

    def top(v):  # moved to bits 4-5
        sh = 2 * (v & 3)
        t = (builder.shl(plane, ir.Constant(v64, [4 - sh] * 64)) if sh < 4 else
             builder.lshr(plane, ir.Constant(v64, [sh - 4] * 64)))
        return builder.and_(t, ir.Constant(v64, [0x30] * 64))
    k = ir.Constant(v64, [bias] * 64)
    return builder.add(builder.or_(lo, top(2 * j)), k), builder.add(builder.or_(hi, top(2 * j + 1)), k)


@intrinsic
def _nib6_unpack(typingctx, qs, rb, g, out):
    """Group g of block rb of a "nib6" qs as int8 codes s = u - 32 into out[0, g], in the "i8"
    layout (whose load j' < 16 is weights 4j'..4j'+3: load j's low nibbles, then at 8 + j its high)."""
    sig = types.none(qs, rb, g, out)

    def codegen(context, builder, sig, args):
        ta, ip = sig.args, types.intp
        cst = lambda v: context.get_constant(ip, v)  # noqa: E731
        rb, g = context.cast(builder, args[1], ta[1], ip), context.cast(builder, args[2], ta[2], ip)
        v64, i8p = ir.VectorType(_I8, 64), _I8.as_pointer()
        at = lambda i, b: builder.bitcast(_ptr(context, builder, ta[i], args[i],  # noqa: E731
                                               [(b, ip), (g, ip), (cst(0), ip), (cst(0), ip)]), i8p)
        src, dst = at(0, rb), at(3, cst(0))
        vp = lambda p, off: builder.bitcast(builder.gep(p, [cst(off)]), v64.as_pointer())  # noqa: E731
        for j in range(8):
            q = builder.load(vp(src, 64 * j), align=1)
            lo, hi = _six_bits(builder, builder.and_(q, ir.Constant(v64, [15] * 64)),
                               builder.lshr(q, ir.Constant(v64, [4] * 64)),
                               builder.load(vp(src, 512 + 64 * (j >> 1)), align=1), j, 256 - 32)
            builder.store(lo, vp(dst, 64 * j), align=1)
            builder.store(hi, vp(dst, 64 * (8 + j)), align=1)
        return context.get_dummy_value()
    return sig, codegen


def _make_group(kind, sub, has_m, n_tok, six=False):
    """An intrinsic group(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rq): weights g*64..g*64+63 of
    the rows of block rb (their codes in qs's block rq) against tokens t..t+n_tok-1, added into
    y[t', 16rb:16rb+16] sub-block by sub-block. Each row's 64 codes are one vector of bytes
    (4-bit ones unpacked: low nibbles, then high; 5-bit ones with their bit plane), multiplied
    with a token's 64 int8 activations by one vpdpbusd; with 2 tokens the codes are loaded and
    unpacked once for both. d and m of one byte (K-quants) are multiplied by their super-block's
    float16 scales in sup (qtypes): the codegen specializes on their dtype."""

    @intrinsic
    def group(typingctx, qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rq):
        sig = types.none(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rq)

        def codegen(context, builder, sig, args):
            if n_tok == 8 and not _HAS_BW:  # AVX2's 16 vector registers: two passes of 4 tokens (10-25% faster
                for half in (0, 4):         # at 8-16 tokens than 8 tokens' sums at once, measured on Zen 3)
                    emit(context, builder, sig, [builder.add(v, context.get_constant(sig.args[4], half)) if i == 4 else v
                                                 for i, v in enumerate(args)], 4)
                return context.get_dummy_value()
            return emit(context, builder, sig, args, n_tok)

        def emit(context, builder, sig, args, n_tok):
            qs_v, rb_v, g_v, xq_v, t_v, d_v, m_v, sup_v, c_v, xd_v, xs_v, y_v, rq_v = args
            ta = sig.args
            ip = types.intp
            cst = lambda v: context.get_constant(ip, v)
            rb = context.cast(builder, rb_v, ta[1], ip)
            rq = context.cast(builder, rq_v, ta[12], ip)  # the block of qs (rb's, or 0 of a scratch copy)
            g = context.cast(builder, g_v, ta[2], ip)
            t0 = context.cast(builder, t_v, ta[4], ip)
            toks = [builder.add(t0, cst(u)) for u in range(n_tok)]
            vf = ir.VectorType(_F32, ROWS)
            v64 = ir.VectorType(_I8, 64)
            v16i = ir.VectorType(_I32, ROWS)
            i8p = ir.IntType(8).as_pointer()
            col = builder.mul(g, cst(64))
            base = builder.bitcast(_ptr(context, builder, ta[0], qs_v, [(rq, ip), (g, ip), (cst(0), ip), (cst(0), ip)]),
                                   i8p)  # the block's group: _GROUP_BYTES[kind] bytes
            at = lambda p, off, ty: builder.load(builder.bitcast(builder.gep(p, [cst(off)]), ty.as_pointer()), align=1)
            for off in range(0, _GROUP_BYTES[kind], 64):  # the codes PREFETCH_AHEAD bytes on, a line each
                _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [builder.gep(base, [cst(off + PREFETCH_AHEAD)]),
                      ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
            xps = [builder.bitcast(_ptr(context, builder, ta[3], xq_v, [(tu, ip), (col, ip)]), i8p) for tu in toks]

            def xb(u, off):  # token u's activations off..off+3, in every lane
                v = builder.insert_element(ir.Constant(v16i, ir.Undefined), at(xps[u], off, _I32), ir.Constant(_I32, 0))
                return builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(v16i, [0] * ROWS)), v64)
            per = 64 // sub  # sub-blocks per group
            # per token, sub-block and part: 16 rows' integer sums, a row a lane; fewer tokens
            # take more parts, so that enough independent vpdpbusd chains are in flight
            parts = max(4 // n_tok, 1)
            acc = [[[None] * parts for _ in range(per)] for _ in toks]

            def add(codes, w):  # codes: weights w..w+3 of the 16 rows, 4 bytes a row
                k, p = w // sub, (w // 4) % parts
                for u in range(n_tok):
                    acc[u][k][p] = _dpbusd(builder, acc[u][k][p], codes, xb(u, w), "i8" if kind == "nib6" else kind)
            lut = _TABLES.get(kind)  # the lookup layouts: nibbles, then their table's values as s + 128
            if lut is not None and _SIGNED_LUT:
                lut = lut - 128

            def splat(x):
                v = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(_I32, 0))
                return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, ROWS), [0] * ROWS))

            cv = context.cast(builder, c_v, ta[8], types.float32)
            if kind in ("i8", "nib6") and not _I8_SIGNED or lut is not None and not _SIGNED_LUT:
                cv = builder.fsub(cv, ir.Constant(_F32, I8_SHIFT))
            cv = splat(cv)

            def sup_scale(plane):  # the group's super-block (256 weights: 4 groups) of a K-quant: 16 rows' D or -Dmin
                return _load_scales(context, builder, ta[7], sup_v,
                                    [(rb, ip), (builder.lshr(g, cst(2)), ip), (cst(plane), ip), (cst(0), ip)], ROWS)
            d_sup = sup_scale(0) if ta[5].dtype.bitwidth == 8 else None
            m_sup = sup_scale(1) if has_m and ta[6].dtype.bitwidth == 8 else None

            def scales(k):  # sub-block k's d and m + c*d of the 16 rows, shared by the tokens
                dv = _load_scales(context, builder, ta[5], d_v, [(rb, ip), (k, ip), (cst(0), ip)], ROWS)
                if d_sup is not None:  # exact: the float32 a stored copy of d would hold
                    dv = builder.fmul(d_sup, dv)
                if has_m:
                    mv = _load_scales(context, builder, ta[6], m_v, [(rb, ip), (k, ip), (cst(0), ip)], ROWS)
                    if m_sup is not None:
                        mv = builder.fmul(m_sup, mv)
                else:
                    mv = splat(_load_scales(context, builder, ta[6], m_v, [(cst(0), ip), (k, ip), (cst(0), ip)], 1))
                return dv, builder.fadd(mv, builder.fmul(cv, dv))

            def y_ptr(tu):
                return _vec_ptr(context, builder, ta[11], y_v, [(tu, ip), (builder.mul(rb, cst(ROWS)), ip)], vf)

            def update(tu, yv, k, s, dv, mcd):  # y + sub-block k's share, as the scalar path's _term
                xk = k if sub == 32 else builder.udiv(k, cst(2))  # the activation scale covers 32 weights
                xdv = splat(builder.load(_ptr(context, builder, ta[9], xd_v, [(tu, ip), (xk, ip)])))
                xsv = splat(builder.load(_ptr(context, builder, ta[10], xs_v, [(tu, ip), (k, ip)])))
                a = builder.fmul(builder.fmul(dv, xdv), builder.sitofp(s, vf))
                return builder.fadd(yv, builder.fadd(a, builder.fmul(mcd, xsv)))

            def five(off):  # a "nib5" load's fifth bits: a 64-bit mask, after the nibbles
                return builder.select(builder.bitcast(at(base, off, ir.IntType(64)), ir.VectorType(ir.IntType(1), 64)),
                                      ir.Constant(v64, [16] * 64), ir.Constant(v64, [0] * 64))

            limit = _ACC16.get("six" if six else kind)
            if limit and n_tok >= 4:  # sub-block by sub-block, each one's sums and y update done before the next
                v16, v16h = ir.VectorType(_I16, 32), ir.VectorType(_I16, 16)
                ones = ir.Constant(v16, [1] * 32)
                for e in range(per):
                    s32, s16, n16 = [None] * n_tok, [None] * n_tok, 0
                    for w in range(e * sub, e * sub + sub, 4):
                        if kind == "i8":  # Q6_K's codes s (|s| <= 32) as |s|, the activations' signs flipped to match
                            q = _halves(builder, at(base, 16 * w, v64))
                            codes = [_call(builder, "llvm.abs.v32i8", h.type, [h, ir.Constant(ir.IntType(1), 0)]) for h in q]
                            acts = lambda u: [_call(builder, "llvm.x86.avx2.psign.b", h.type, [h, qh])  # noqa: E731
                                              for h, qh in zip(_halves(builder, xb(u, w)), q)]
                        else:  # load w % 32 // 4: low nibbles below 32, high above
                            j, high = w % 32 // 4, w >= 32
                            q = at(base, 64 * j, v64)
                            c4 = builder.lshr(q, ir.Constant(v64, [4] * 64)) if high else builder.and_(q, ir.Constant(v64, [15] * 64))
                            if kind == "nib5":
                                c4 = builder.or_(c4, five(512 + 16 * j + 8 * high))
                            codes = _halves(builder, c4)
                            acts = lambda u: _halves(builder, xb(u, w))  # noqa: E731
                        for u in range(n_tok):
                            pr = _join(builder, *(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16h, [a, b])
                                                  for a, b in zip(codes, acts(u))))
                            s16[u] = pr if s16[u] is None else builder.add(s16[u], pr)
                        n16 += 1
                        if n16 == limit or w + 4 == e * sub + sub:  # widened to int32
                            for u in range(n_tok):
                                wide = _madd(builder, s16[u], ones)
                                s32[u] = wide if s32[u] is None else builder.add(s32[u], wide)
                            s16, n16 = [None] * n_tok, 0
                    k = builder.add(builder.mul(g, cst(per)), cst(e))
                    dv, mcd = scales(k)
                    for tu, s in zip(toks, s32):
                        py = y_ptr(tu)
                        builder.store(update(tu, builder.load(py, align=4), k, s, dv, mcd), py, align=4)
                return context.get_dummy_value()
            if kind == "i8":  # signed codes s as unsigned s + 128 (c moves down by 128: I8_SHIFT), or as they are
                for j in range(16):
                    q = at(base, 64 * j, v64)
                    add(q if _I8_SIGNED else builder.xor(q, ir.Constant(v64, [0x80] * 64)), 4 * j)
            else:  # byte b of row i in load j: weight 4j+b (low nibble) and 32+4j+b (high)
                for j in range(8):
                    q = at(base, 64 * j, v64)
                    lo = builder.and_(q, ir.Constant(v64, [15] * 64))
                    hi = builder.lshr(q, ir.Constant(v64, [4] * 64))
                    if kind == "nib5":  # their fifth bits
                        lo = builder.or_(lo, five(512 + 16 * j))
                        hi = builder.or_(hi, five(512 + 16 * j + 8))
                    if kind == "nib6":  # their top two bits; u -> s + 128 or s, as the i8 kind's codes
                        lo, hi = _six_bits(builder, lo, hi, at(base, 512 + 64 * (j >> 1), v64), j, _NIB6_ADD)
                    if lut is not None:
                        lo, hi = _lookup(builder, lo, lut), _lookup(builder, hi, lut)
                    add(lo, 4 * j)
                    add(hi, 32 + 4 * j)
            def total(ps):
                ps = [v for v in ps if v is not None]
                while len(ps) > 1:
                    ps = [builder.add(ps[i], ps[i + 1]) if i + 1 < len(ps) else ps[i] for i in range(0, len(ps), 2)]
                return ps[0]
            sums = [[(builder.add(builder.mul(g, cst(per)), cst(e)), total(a[e])) for e in range(per)] for a in acc]
            scl = [scales(k) for k, _ in sums[0]]
            for tu, tok_sums in zip(toks, sums):
                py = y_ptr(tu)
                yv = builder.load(py, align=4)
                for (k, s), (dv, mcd) in zip(tok_sums, scl):
                    yv = update(tu, yv, k, s, dv, mcd)
                builder.store(yv, py, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return group


_G = {(kind, sub, has_m, n): _make_group(kind, sub, has_m, n)
      for kind, sub in (("nib", 32), ("nib", 16), ("i8", 32), ("i8", 16), ("nib5", 32), ("iq4nl", 32), ("mxfp4", 32),
                        ("nib6", 16))
      for has_m in (False, True) for n in (1, 2, 4) + ((8,) if sub == 32 else ())}
_nib32, _nib32m, _nib32_2, _nib32m_2, _nib32_4, _nib32m_4 = (_G[("nib", 32, hm, n)] for n in (1, 2, 4) for hm in (False, True))
_nib16, _nib16m, _nib16_2, _nib16m_2, _nib16_4, _nib16m_4 = (_G[("nib", 16, hm, n)] for n in (1, 2, 4) for hm in (False, True))
_i8_32, _i8_32m, _i8_32_2, _i8_32m_2, _i8_32_4, _i8_32m_4 = (_G[("i8", 32, hm, n)] for n in (1, 2, 4) for hm in (False, True))
_i8_16, _i8_16m, _i8_16_2, _i8_16m_2, _i8_16_4, _i8_16m_4 = (_G[("i8", 16, hm, n)] for n in (1, 2, 4) for hm in (False, True))
_nib5, _nib5m, _nib5_2, _nib5m_2, _nib5_4, _nib5m_4 = (_G[("nib5", 32, hm, n)] for n in (1, 2, 4) for hm in (False, True))
_nib6, _nib6_2, _nib6_4 = (_G[("nib6", 16, False, n)] for n in (1, 2, 4))  # Q6_K: no minimum
_iq4, _iq4_2, _iq4_4 = (_G[("iq4nl", 32, False, n)] for n in (1, 2, 4))
_fp4, _fp4_2, _fp4_4 = (_G[("mxfp4", 32, False, n)] for n in (1, 2, 4))
_nib32_8, _nib32m_8 = (_G[("nib", 32, hm, 8)] for hm in (False, True))
_i8_32_8, _i8_32m_8 = (_G[("i8", 32, hm, 8)] for hm in (False, True))
_nib5_8, _nib5m_8 = (_G[("nib5", 32, hm, 8)] for hm in (False, True))
_iq4_8, _fp4_8 = _G[("iq4nl", 32, False, 8)], _G[("mxfp4", 32, False, 8)]
_six_4 = _make_group("i8", 16, False, 4, six=True)  # Q6_K's codes unpacked to int8: |s| <= 32 (_ACC16)


# The scalar loops (rows past the last whole 16) keep constant trip counts and several
# independent sums on purpose: LLVM vectorizes them whole; the int32 casts keep the sums narrow
# (numba widens integer arithmetic to int64 otherwise).

@numba.njit(inline="always", cache=True, nogil=True)
def _term(d, m, sup, ms, c, sub, r, k, xdv, s, xsv):
    """Sub-block k's share of row r's dot product, as the vector update computes it."""
    dk = sub_scale(d, sup, 0, sub, r >> 4, k, r & 15)
    return dk * xdv * np.float32(s) + (sub_scale(m, sup, 1, sub, (r >> 4) * ms, k, (r & 15) * ms) + c * dk) * xsv


@numba.njit(inline="always", cache=True, nogil=True)
def _row_nibs(qs, d, m, sup, ms, c, xq, xd, xs, r, t, sub, lut):
    """Row r (one past the last whole block of 16) against token t, nibble layouts; `lut` maps
    a code to what enters the sums (_ID32, or a table's values as s + 128 (or s: _I8_OFF), c lower by as much)."""
    acc = np.float32(0.0)
    for g in range(qs.shape[1]):
        for e in range(64 // sub):
            s = np.int32(0)
            for u in range(sub):
                w = e * sub + u
                s = np.int32(s + lut[nib_code(qs, r, g, w)] * np.int32(xq[t, g * 64 + w]))
            k = g * (64 // sub) + e
            acc = acc + _term(d, m, sup, ms, c, sub, r, k, xd[t, (k * sub) // 32], s, xs[t, k])
    return acc


@numba.njit(inline="always", cache=True, nogil=True)
def _row_i8(qs, d, m, sup, ms, c, xq, xd, xs, r, t, sub):
    """As _row_nibs for int8 codes (qs[block, group, j, 4i+b] = row i's weight 4j+b), entering
    the sums as the vector path takes them: s + 128 with c lower by 128, or s (_I8_OFF 0)."""
    acc = np.float32(0.0)
    c = c - np.float32(_I8_OFF)
    i = r & 15
    for g in range(qs.shape[1]):
        for e in range(64 // sub):
            s = np.int32(0)
            for u in range(sub):
                w = e * sub + u
                s = np.int32(s + (np.int32(qs[r >> 4, g, w >> 2, 4 * i + (w & 3)]) + np.int32(_I8_OFF))
                             * np.int32(xq[t, g * 64 + w]))
            k = g * (64 // sub) + e
            acc = acc + _term(d, m, sup, ms, c, sub, r, k, xd[t, (k * sub) // 32], s, xs[t, k])
    return acc


# The kernels: qs, d, m, sup, ms, c in qtypes' blocked layout; xq, xd, xs from quantize.quantize_x
# -> y (n_tok, n_rows). Task rb < n_rows // 16 takes block rb through the vector groups; the
# last, the rows of a partial block. One kernel per family, alike on purpose: a single kernel
# choosing the family's intrinsics at run time measured 4-13% slower at 16-128 tokens.

@numba.njit(**_JIT)
def dot_nib32(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """4-bit codes, a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c, xq, xd, xs, r, t, 32, _ID32)
            continue
        for t in range(0, n_tok, 8):  # tokens 8 at a time (then 4, 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 8, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 7 < n_tok:
                    if ms:
                        _nib32m_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib32_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 3 < n_tok:
                    if ms:
                        _nib32m_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib32_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 4
                if u + 1 < n_tok:
                    if ms:
                        _nib32m_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib32_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    if ms:
                        _nib32m(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib32(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)




@numba.njit(**_JIT)
def dot_nib5_32(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """5-bit codes (4-bit nibbles and a bit plane), a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c, xq, xd, xs, r, t, 32, _ID32)
            continue
        for t in range(0, n_tok, 8):  # tokens 8 at a time (then 4, 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 8, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 7 < n_tok:
                    if ms:
                        _nib5m_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib5_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 3 < n_tok:
                    if ms:
                        _nib5m_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib5_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 4
                if u + 1 < n_tok:
                    if ms:
                        _nib5m_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib5_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    if ms:
                        _nib5m(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib5(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_nib16(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """4-bit codes, a scale per 16 (Q2_K, Q3_K)."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c, xq, xd, xs, r, t, 16, _ID32)
            continue
        for t in range(0, n_tok, 4):  # tokens 4 at a time (then 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 4, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 3 < n_tok:
                    if ms:
                        _nib16m_4(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib16_4(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 1 < n_tok:
                    if ms:
                        _nib16m_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib16_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    if ms:
                        _nib16m(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _nib16(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_i8_32(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """int8 codes, a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_i8(qs, d, m, sup, ms, c, xq, xd, xs, r, t, 32)
            continue
        for t in range(0, n_tok, 8):  # tokens 8 at a time (then 4, 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 8, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 7 < n_tok:
                    if ms:
                        _i8_32m_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_32_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 3 < n_tok:
                    if ms:
                        _i8_32m_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_32_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 4
                if u + 1 < n_tok:
                    if ms:
                        _i8_32m_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_32_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    if ms:
                        _i8_32m(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_32(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_i8_16(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """int8 codes, a scale per 16 (Q6_K)."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_i8(qs, d, m, sup, ms, c, xq, xd, xs, r, t, 16)
            continue
        for t in range(0, n_tok, 4):  # tokens 4 at a time (then 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 4, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 3 < n_tok:
                    if ms:
                        _i8_16m_4(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_16_4(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 1 < n_tok:
                    if ms:
                        _i8_16m_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_16_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    if ms:
                        _i8_16m(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    else:
                        _i8_16(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_iq4nl_32(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """4-bit indices into IQ4_NL's table (IQ4_NL, IQ4_XS), a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c - np.float32(I8_SHIFT), xq, xd, xs, r, t, 32, _LUT_IQ4)
            continue
        for t in range(0, n_tok, 8):  # tokens 8 at a time (then 4, 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 8, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 7 < n_tok:
                    _iq4_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 3 < n_tok:
                    _iq4_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 4
                if u + 1 < n_tok:
                    _iq4_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    _iq4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_mxfp4_32(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """4-bit indices into MXFP4's table (doubled e2m1), a scale per 32."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c - np.float32(I8_SHIFT), xq, xd, xs, r, t, 32, _LUT_FP4)
            continue
        for t in range(0, n_tok, 8):  # tokens 8 at a time (then 4, 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 8, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 7 < n_tok:
                    _fp4_8(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 3 < n_tok:
                    _fp4_4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 4
                if u + 1 < n_tok:
                    _fp4_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    _fp4(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


@numba.njit(**_JIT)
def dot_nib6_16(qs, d, m, sup, ms, c, xq, xd, xs, y):
    """6-bit codes (nibbles and 2-bit planes), a scale per 16 (Q6_K): the "i8" kind's integers.
    Over 4 tokens, each block's codes are unpacked once into an int8 copy that the "i8" kernels
    read: unpacking per 4 tokens cost 10-15% at 64-512 tokens (one thread)."""
    nb = y.shape[1] // ROWS
    n_tok = xq.shape[0]
    for rb in prange(nb + 1):
        if rb == nb:
            for t in range(n_tok):
                for r in range(nb * ROWS, y.shape[1]):
                    y[t, r] = _row_nibs(qs, d, m, sup, ms, c - np.float32(_I8_OFF), xq, xd, xs, r, t, 16, _LUT6)
            continue
        if n_tok > 4:
            q8 = np.empty((1, qs.shape[1], ROWS, 64), np.int8)  # the block as the "i8" layout (its block 0)
            for g in range(qs.shape[1]):
                _nib6_unpack(qs, rb, g, q8)
            for t in range(0, n_tok, 4):
                for u in range(t, min(t + 4, n_tok)):
                    y[u, rb * ROWS:rb * ROWS + ROWS] = 0
                for g in range(qs.shape[1]):
                    if t + 3 < n_tok:
                        _six_4(q8, rb, g, xq, t, d, m, sup, c, xd, xs, y, 0)
                        continue
                    u = t
                    if u + 1 < n_tok:
                        _i8_16_2(q8, rb, g, xq, u, d, m, sup, c, xd, xs, y, 0)
                        u += 2
                    if u < n_tok:
                        _i8_16(q8, rb, g, xq, u, d, m, sup, c, xd, xs, y, 0)
            continue
        for t in range(0, n_tok, 4):  # tokens 4 at a time (then 2, 1): one load and unpack of the codes for all
            for u in range(t, min(t + 4, n_tok)):
                y[u, rb * ROWS:rb * ROWS + ROWS] = 0
            for g in range(qs.shape[1]):
                if t + 3 < n_tok:
                    _nib6_4(qs, rb, g, xq, t, d, m, sup, c, xd, xs, y, rb)
                    continue
                u = t
                if u + 1 < n_tok:
                    _nib6_2(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)
                    u += 2
                if u < n_tok:
                    _nib6(qs, rb, g, xq, u, d, m, sup, c, xd, xs, y, rb)


# The family travels as a type: a tag, an empty array whose dtype names it (TAGS[kind]), so
# that compiled callers specialize on it and only the families a model's weights use are ever
# compiled (a first run compiles them: each is seconds of LLVM). An integer `kind` would be one
# type for all four, and each caller would compile every family.
TAGS = tuple(np.empty(0, dt) for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                         np.uint64))  # by qtypes.KINDS


def _family(tag, qs, d, m, sup, ms, c, xq, xd, xs, y):
    """The kernel of the family that `tag` names; compiled code only (see the overload)."""
    raise NotImplementedError


@overload(_family)
def _family_for_tag(tag, qs, d, m, sup, ms, c, xq, xd, xs, y):
    kernel = {"int8": dot_nib32, "int16": dot_nib16, "int32": dot_i8_32, "int64": dot_i8_16,
              "uint8": dot_nib5_32, "uint16": dot_iq4nl_32, "uint32": dot_mxfp4_32,
              "uint64": dot_nib6_16}[str(tag.dtype)]

    def impl(tag, qs, d, m, sup, ms, c, xq, xd, xs, y):
        kernel(qs, d, m, sup, ms, c, xq, xd, xs, y)
    return impl


@numba.njit(cache=True, nogil=True)
def dot_any(tag, qs, d, m, sup, ms, c, xq, xd, xs, y):
    """The kernel of the family `tag` names (TAGS), chosen when a caller is compiled."""
    _family(tag, qs, d, m, sup, ms, c, xq, xd, xs, y)
