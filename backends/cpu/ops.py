"""numba kernels for the non-matmul ops: norms, activations, RoPE, attention over the
paged KV cache. Small and pure so that they JIT well; cache=True so a second process
starts without recompiling."""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .halfs import VW, _call, _ptr, _splat, _vec_ptr, bits_as_f32, f32, like, widen
from .kvquant import fwht, load_row, put_row

# error_model="numpy": a float division by zero gives inf/NaN, as in numpy and ggml, not a
# ZeroDivisionError out of a norm of garbage weights
_JIT = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")
# The GLU kernels without reassociation (fastmath's other flags kept): numba optimizes a parallel
# loop's body in its own module, then again linked into its caller's; a process that has just compiled
# the kernels runs the first copy, one that loaded them from numba's cache the second. Free to
# reassociate, LLVM ordered the GELU's products differently in the two, so outputs depended on the
# cache's state (Gemma 3's cpu golden, case 0 step 6: 0.29 nat off llama.cpp freshly compiled, 0.18
# cached). Attention's too: on a 2-core Intel Xeon (LLVM's rocketlake) its float16 case differed by
# ~5e-7 compiled and cached, enough to flip a near-tie in a q4_0-cache golden.
# tests/test_kernel_cache.py holds every float kernel to the same bits both ways.
_JIT_ORDERED = dict(_JIT, fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"})
ATT_BLOCK = 32  # positions per step of attention's online softmax
# positions per attention task: decode has one token and a few KV heads, too few tasks for the
# cores without splitting the context; a fixed split, so a token's result never depends on its batch
ATT_SPLIT = 128
MERGE_PAR_MIN = 1 << 16  # parts x heads x dv from which the merge runs on every thread


@numba.njit(inline="always", **_JIT)
def fexp(x):
    """exp(x) in float32 for x in about [-87, 88] (clamped outside), to a few ulp: Cody-Waite
    range reduction and a degree-6 polynomial (Cephes' expf), branch-free so that loops over it
    vectorize (math.exp is a scalar libm call per element)."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)  # ln 2 in two parts: n * the first is exact
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * bits_as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


# Each row-parallel kernel has a serial twin (name_1) for a few rows: a parallel launch costs a
# few microseconds, more than a decode token's row of work; backend.py picks by row count.
PAR_MIN_ROWS = 4


@numba.njit(parallel=True, cache=True)
def start_threads(x):
    """Called through its own dispatcher, which starts numba's thread pool (matmul.start_pool)."""
    for i in prange(x.shape[0]):
        x[i] = i


@numba.njit(inline="always", **_JIT)
def _rms_row(x, w, eps, out, r):
    n = x.shape[1]
    ss = 0.0
    for j in range(n):
        ss += np.float64(x[r, j]) * x[r, j]
    inv = np.float32(1.0 / math.sqrt(ss / n + eps))
    if w.shape[0] == 0:
        for j in range(n):
            out[r, j] = x[r, j] * inv
    else:
        for j in range(n):
            out[r, j] = x[r, j] * inv * w[j]


@numba.njit(parallel=True, **_JIT)
def rms_norm(x, w, eps, out):
    """x, out (n_rows, n); w (n,) or empty (no weight)."""
    for r in prange(x.shape[0]):
        _rms_row(x, w, eps, out, r)


@numba.njit(**_JIT)
def rms_norm_1(x, w, eps, out):
    for r in range(x.shape[0]):
        _rms_row(x, w, eps, out, r)


# rms_norm of each head of each token, x (n_tokens, n_head, d) as it lies: several tokens' q or k
# are a strided slice of the fused QKV product, and a contiguous copy would be a fresh array each
# step, which replay.py cannot record. _rms_row on each token's (n_head, d): bitwise rms_norm of the rows.
@numba.njit(parallel=True, **_JIT)
def rms_norm_heads(x, w, eps, out):
    for t in prange(x.shape[0]):
        for h in range(x.shape[1]):
            _rms_row(x[t], w, eps, out[t], h)  # token t's heads as rows


@numba.njit(**_JIT)
def rms_norm_heads_1(x, w, eps, out):
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            _rms_row(x[t], w, eps, out[t], h)  # token t's heads as rows


@numba.njit(inline="always", **_JIT_ORDERED)
def _gelu(v):
    """tanh GELU, with tanh(u) = 1 - 2 / (exp(2u) + 1) on the vectorizing exp."""
    u = np.float32(0.7978845608028654) * (v + np.float32(0.044715) * v * v * v)
    th = np.float32(1.0) - np.float32(2.0) / (fexp(np.float32(2.0) * u) + np.float32(1.0))
    return np.float32(0.5) * v * (np.float32(1.0) + th)


@numba.njit(inline="always", **_JIT_ORDERED)
def _silu(v):
    return v / (np.float32(1.0) + fexp(-v))


@numba.njit(inline="always", **_JIT_ORDERED)
def _glu_row(gate, up, act_gelu, out, r):
    for j in range(gate.shape[1]):
        g = gate[r, j]
        a = _gelu(g) if act_gelu else _silu(g)
        out[r, j] = a * (up[r, j] if up.shape[0] else np.float32(1.0))


@numba.njit(parallel=True, **_JIT_ORDERED)
def glu(gate, up, act_gelu, out):
    """out = act(gate) * up; (n_rows, n) each. act_gelu selects GELU(tanh) over SiLU."""
    for r in prange(gate.shape[0]):
        _glu_row(gate, up, act_gelu, out, r)


@numba.njit(**_JIT_ORDERED)
def glu_1(gate, up, act_gelu, out):
    for r in range(gate.shape[0]):
        _glu_row(gate, up, act_gelu, out, r)


@numba.njit(parallel=True, **_JIT_ORDERED)
def glu_oai(gate, up, alpha, limit, out):
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): x = min(gate, limit), y = clip(up, -limit, limit),
    out = x * sigmoid(alpha * x) * (y + 1); (n_rows, n) each."""
    for r in prange(gate.shape[0]):
        for j in range(gate.shape[1]):
            x = min(gate[r, j], limit)
            y = min(max(up[r, j], -limit), limit)
            out[r, j] = x / (np.float32(1.0) + fexp(-alpha * x)) * (y + np.float32(1.0))


@numba.njit(**_JIT)
def _rope_angles(ps, n_rot, base, freq_scale, freqs, mscale, comps, cs, cp):
    """cs (n_rot/2, 2): each pair's float32 (cos, sin) times mscale at the positions ps, unless cp
    (the positions they were made for) already equals ps: a step's layers share one table per
    RoPE kind, and only its first layer pays for pow, cos and sin. The values are those computed
    in place before the table, bit for bit."""
    same = True
    for j in range(ps.shape[0]):
        if cp[j] != ps[j]:
            same = False
    if same:
        return
    for i in range(n_rot // 2):
        p = ps[comps[i]] if comps.shape[0] else ps[0]
        if freqs.shape[0]:
            theta = np.float64(p) * freqs[i]
        else:
            theta = freq_scale * np.float64(p) * base ** (-2.0 * i / n_rot)
        cs[i, 0], cs[i, 1] = np.float32(mscale * math.cos(theta)), np.float32(mscale * math.sin(theta))
    for j in range(ps.shape[0]):
        cp[j] = ps[j]


@numba.njit(**_JIT)
def _rope_token(x, ps, n_rot, base, freq_scale, neox, freqs, mscale, comps, out, cs, cp):
    """x, out (n_heads, head_dim) of one token at position ps[0] (or, multi-position RoPE with
    `comps` (n_rot/2) not empty, pair i at ps[comps[i]]); out may be x, or a KV cache row
    (float16 bits: see halfs). `freqs` (n_rot/2; empty: from base and freq_scale) are scaled
    RoPE's per-dimension frequencies, `mscale` its cos/sin magnitude. cs, cp: this token's row of
    the angle table (rope_table)."""
    half = n_rot // 2
    _rope_angles(ps, n_rot, base, freq_scale, freqs, mscale, comps, cs, cp)
    for j in range(n_rot, x.shape[1]):
        for h in range(x.shape[0]):
            out[h, j] = like(out, x[h, j])
    for i in range(half):
        c, s = cs[i, 0], cs[i, 1]
        i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
        for h in range(x.shape[0]):
            x0, x1 = x[h, i0], x[h, i1]
            out[h, i0] = like(out, x0 * c - x1 * s)
            out[h, i1] = like(out, x0 * s + x1 * c)


NO_POS = np.iinfo(np.int64).min  # a table row made for no position yet


def rope_table(n_tokens: int, n_rot: int, n_comps: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty angle table for n_tokens: (cs (n_tokens, n_rot/2, 2) float32, cp (n_tokens, n_comps)
    int64, the positions each row was made for)."""
    return np.zeros((n_tokens, n_rot // 2, 2), np.float32), np.full((n_tokens, n_comps), NO_POS, np.int64)


@numba.njit(parallel=True, **_JIT)
def rope(x, pos, n_rot, base, freq_scale, neox, freqs, mscale, comps, out, cs, cp):
    """x, out (n_tokens, n_heads, head_dim); rotate the first n_rot dims of each head."""
    for t in prange(x.shape[0]):
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, out[t], cs[t], cp[t])


@numba.njit(**_JIT)
def rope_1(x, pos, n_rot, base, freq_scale, neox, freqs, mscale, comps, out, cs, cp):
    for t in range(x.shape[0]):
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, out[t], cs[t], cp[t])


@numba.njit(parallel=True, **_JIT)
def rope_set_rows(x, pos, slots, n_rot, base, freq_scale, neox, freqs, mscale, comps, cache, cs, cp):
    """cache[slots[t]] = rope(x[t]): K goes into the cache rotated, with no rotated copy."""
    for t in prange(x.shape[0]):
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, cache[slots[t]], cs[t], cp[t])


@numba.njit(**_JIT)
def rope_set_rows_1(x, pos, slots, n_rot, base, freq_scale, neox, freqs, mscale, comps, cache, cs, cp):
    for t in range(x.shape[0]):
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, cache[slots[t]], cs[t], cp[t])


@numba.njit(parallel=True, **_JIT)
def rope_set_rows_q(x, pos, slots, n_rot, base, freq_scale, neox, freqs, mscale, comps, cache, kind, rot, cs, cp):
    """rope_set_rows into a cache of blocks of type `kind`, or one that is Hadamard-rotated by H_rot
    (kvquant): each token RoPE-rotated into a float row, then stored into its slot."""
    for t in prange(x.shape[0]):
        r = np.empty(x.shape[1:], np.float32)
        tmp = np.empty(x.shape[2], np.float32)
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, r, cs[t], cp[t])
        for h in range(x.shape[1]):
            put_row(r[h], cache[slots[t], h], kind, rot, tmp)


@numba.njit(**_JIT)
def rope_set_rows_q_1(x, pos, slots, n_rot, base, freq_scale, neox, freqs, mscale, comps, cache, kind, rot, cs, cp):
    r = np.empty(x.shape[1:], np.float32)
    tmp = np.empty(x.shape[2], np.float32)
    for t in range(x.shape[0]):
        _rope_token(x[t], pos[t], n_rot, base, freq_scale, neox, freqs, mscale, comps, r, cs[t], cp[t])
        for h in range(x.shape[1]):
            put_row(r[h], cache[slots[t], h], kind, rot, tmp)


@numba.njit(parallel=True, **_JIT)
def rms_norm_add(x, w, r, eps, out):
    """out = rms_norm(x) * w + r; (n_rows, n) each, w (n,). out may be x or r."""
    n = x.shape[1]
    for i in prange(x.shape[0]):
        ss = 0.0
        for j in range(n):
            ss += np.float64(x[i, j]) * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / n + eps))
        for j in range(n):
            out[i, j] = x[i, j] * inv * w[j] + r[i, j]


@numba.njit(parallel=True, **_JIT)
def kq(q, k, tok_seq, out):
    """out[t, h, p] = q[t, h] . k[seq(t), p, h // group]; q (n_tokens, n_head, d), k (n_seqs, n_kv, h_kv, d)."""
    n_tokens, n_head, d = q.shape
    group = n_head // k.shape[2]
    for job in prange(n_tokens * n_head):
        t, h = job // n_head, job % n_head
        s, kh = tok_seq[t], h // group
        for p in range(k.shape[1]):
            acc = np.float32(0.0)
            for j in range(d):
                acc += q[t, h, j] * k[s, p, kh, j]
            out[t, h, p] = acc


@numba.njit(parallel=True, **_JIT)
def kqv(probs, v, tok_seq, out):
    """out[t, h] = sum_p probs[t, h, p] v[seq(t), p, h // group]; out (n_tokens, n_head, dv)."""
    n_tokens, n_head, n_kv = probs.shape
    group = n_head // v.shape[2]
    for job in prange(n_tokens * n_head):
        t, h = job // n_head, job % n_head
        s, kh = tok_seq[t], h // group
        for j in range(v.shape[3]):
            out[t, h, j] = 0.0
        for p in range(n_kv):
            w = probs[t, h, p]
            if w != 0.0:  # masked positions: most of the row in a short context
                for j in range(v.shape[3]):
                    out[t, h, j] += w * v[s, p, kh, j]


@numba.njit(inline="always", **_JIT)
def _set_row(cache, src, slots, t, kind, rot, tmp):
    for h in range(cache.shape[1]):
        put_row(src[t, h], cache[slots[t], h], kind, rot, tmp)


@numba.njit(parallel=True, **_JIT)
def set_rows(cache, src, slots, kind=0, rot=0):
    """cache (n_slots, h, d)[slots[t]] = src[t] (float32, or float16 bits: see halfs; or blocks of
    type `kind`, Hadamard-rotated by H_rot where rot > 0: kvquant)."""
    for t in prange(slots.shape[0]):
        _set_row(cache, src, slots, t, kind, rot, np.empty(src.shape[2], np.float32))


@numba.njit(**_JIT)
def set_rows_1(cache, src, slots, kind=0, rot=0):
    tmp = np.empty(src.shape[2], np.float32)
    for t in range(slots.shape[0]):
        _set_row(cache, src, slots, t, kind, rot, tmp)


def _row_base(context, builder, sig, args, i_rows: int, i, ip):
    """The address of row i's first value: rows[i] of a 2-D array, or cache[slots[i], kh] of a
    (n_slots, n_kv, d) cache (float32 or float16 bits) read where it lies; args[i_rows:i_rows + 3]
    are (rows or cache, slots, kh)."""
    ta, (src, slots, kh) = sig.args, args[i_rows:i_rows + 3]
    if ta[i_rows].ndim == 2:
        return _ptr(context, builder, ta[i_rows], src, [(i, ip)] + [(context.get_constant(ip, 0), ip)])
    slot = builder.load(_ptr(context, builder, ta[i_rows + 1], slots, [(i, ip)]))
    zero = context.get_constant(ip, 0)
    return _ptr(context, builder, ta[i_rows], src, [(slot, ta[i_rows + 1].dtype), (kh, ta[i_rows + 2]), (zero, ip)])


def _load_vec(builder, base, c, dtype, vf):
    """VW values at base + c as float32: float16 bits widened (halfs.widen), float32 as they are."""
    p = builder.gep(base, [c])
    if dtype == types.uint16:
        return widen(builder, builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(16), VW).as_pointer()), align=2))
    return builder.load(builder.bitcast(p, vf.as_pointer()), align=4)


@intrinsic
def _axpy_rows(typingctx, acc, e, v, slots, kh, nb):
    """acc[:n] += sum over i < nb of e[i] * row i[:n], n = acc's length rounded down to whole
    vectors (the caller adds the rest); row i: v[i] of a 2-D float32 array (slots, kh unused), or
    v[slots[i], kh] of a cache, float32 or float16 bits, read in place (no staging copy). The
    running sums of 8 vectors (then 4, then 1) in registers across the rows, where a loop over acc
    in memory waits on each store: 8 chains of FMAs cover their latency where 4 did not (a
    64-wide head on AVX2 is 8 vectors, once over the rows instead of twice; SmolLM2's attention
    at 1,800 positions 5.2-6.0 -> 4.6-5.2 ms a token on a Zen 3, the same bits)."""
    def codegen(context, builder, sig, args):
        acc_v, e_v, nb_v = args[0], args[1], args[5]
        ta, ip = sig.args, types.intp
        cst = lambda x: context.get_constant(ip, x)  # noqa: E731
        vf = ir.VectorType(ir.FloatType(), VW)
        nb = context.cast(builder, nb_v, ta[5], ip)
        n = cgutils.unpack_tuple(builder, context.make_array(ta[0])(context, builder, acc_v).shape)[0]
        n_vec = builder.sdiv(n, cst(VW))

        def run(c0, width):  # vectors c0..c0+width-1 of acc, over all rows
            cols = [builder.mul(builder.add(c0, cst(u)), cst(VW)) for u in range(width)]
            sums = [cgutils.alloca_once_value(builder, builder.load(_vec_ptr(context, builder, ta[0], acc_v, [(c, ip)], vf),
                                                                    align=4))
                    for c in cols]
            with cgutils.for_range(builder, nb) as loop:
                i = loop.index
                ev = _splat(builder, builder.load(_ptr(context, builder, ta[1], e_v, [(i, ip)])), vf)
                base = _row_base(context, builder, sig, args, 2, i, ip)
                for c, sm in zip(cols, sums):
                    x = _load_vec(builder, base, c, ta[2].dtype, vf)
                    builder.store(_call(builder, f"llvm.fma.v{VW}f32", vf, [ev, x, builder.load(sm)]), sm)
            for c, sm in zip(cols, sums):
                builder.store(builder.load(sm), _vec_ptr(context, builder, ta[0], acc_v, [(c, ip)], vf), align=4)

        n8 = builder.mul(builder.sdiv(n_vec, cst(8)), cst(8))
        with cgutils.for_range_slice(builder, cst(0), n8, cst(8)) as (c0, _):
            run(c0, 8)
        n4 = builder.add(n8, builder.mul(builder.sdiv(builder.sub(n_vec, n8), cst(4)), cst(4)))
        with cgutils.for_range_slice(builder, n8, n4, cst(4)) as (c0, _):
            run(c0, 4)
        with cgutils.for_range(builder, builder.sub(n_vec, n4)) as loop:
            run(builder.add(n4, loop.index), 1)
        return context.get_dummy_value()
    return types.none(acc, e, v, slots, kh, nb), codegen


def _fold_plan(w):
    """Shuffle masks that fold w vectors of w lanes into one vector of their w sums: per level,
    pairs (x, y) -> shuffle(x, y, lo) + shuffle(x, y, hi); returns (levels, order) where order[u]
    is the lane that ends up holding vector u's sum."""
    owners = [[u] * 1 for u in range(w)]  # per vector: the owner of each segment
    levels, seg = [], w
    n = w
    while n > 1:
        half = seg // 2
        lo, hi = [], []
        for s in range(w // seg):
            base = s * seg
            lo += [base + j for j in range(half)] + [w + base + j for j in range(half)]
            hi += [base + half + j for j in range(half)] + [w + base + half + j for j in range(half)]
        levels.append((lo, hi))
        owners = [[o for s in range(len(owners[2 * m])) for o in (owners[2 * m][s], owners[2 * m + 1][s])]
                  for m in range(n // 2)]
        n //= 2
        seg = half
    order = [0] * w
    for lane, u in enumerate(owners[0]):
        order[u] = lane
    return levels, order


_LEVELS, _ORDER = _fold_plan(VW)
assert ATT_BLOCK % VW == 0  # _dot_rows writes whole vectors of scores


@intrinsic
def _dot_rows(typingctx, out, q, kb, slots, kh, nb, scale):
    """out[i] = (q . row i) * scale for i < nb (up to the next multiple of the vector width:
    rows past nb repeat row nb-1); q's length a multiple of the vector width; row i as
    _axpy_rows reads it (kb[i], or kb[slots[i], kh] of a cache in place). A vector of rows at
    a time: each row's products summed in a vector over the columns, then the rows' vectors folded
    into one vector of their sums (a shuffle tree, no sum across one vector's lanes per row)."""
    def codegen(context, builder, sig, args):
        out_v, q_v, nb_v, sc_v = args[0], args[1], args[5], args[6]
        ta, ip = sig.args, types.intp
        cst = lambda x: context.get_constant(ip, x)  # noqa: E731
        i32 = ir.IntType(32)
        vf = ir.VectorType(ir.FloatType(), VW)
        nb = context.cast(builder, nb_v, ta[5], ip)
        scale = context.cast(builder, sc_v, ta[6], types.float32)
        d = cgutils.unpack_tuple(builder, context.make_array(ta[1])(context, builder, q_v).shape)[0]
        n_chunks = builder.sdiv(d, cst(VW))
        zeros = ir.Constant(vf, [0.0] * VW)

        def vec_at(arrty, arr, inds):
            return _vec_ptr(context, builder, arrty, arr, inds, vf)
        last = builder.sub(nb, cst(1))
        n_blocks = builder.sdiv(builder.add(nb, cst(VW - 1)), cst(VW))
        with cgutils.for_range(builder, n_blocks) as blk:
            i0 = builder.mul(blk.index, cst(VW))
            bases = []
            for u in range(VW):
                r = builder.add(i0, cst(u))
                bases.append(_row_base(context, builder, sig, args, 2,
                                       builder.select(builder.icmp_signed("<", r, nb), r, last), ip))
            sums = [cgutils.alloca_once_value(builder, zeros) for _ in range(VW)]
            with cgutils.for_range(builder, n_chunks) as ch:
                c = builder.mul(ch.index, cst(VW))
                qv = builder.load(vec_at(ta[1], q_v, [(c, ip)]), align=4)
                for base, sm in zip(bases, sums):
                    kv = _load_vec(builder, base, c, ta[2].dtype, vf)
                    builder.store(_call(builder, f"llvm.fma.v{VW}f32", vf, [qv, kv, builder.load(sm)]), sm)
            vs = [builder.load(sm) for sm in sums]
            for lo, hi in _LEVELS:
                vs = [builder.fadd(builder.shuffle_vector(vs[2 * m], vs[2 * m + 1], ir.Constant(ir.VectorType(i32, VW), lo)),
                                   builder.shuffle_vector(vs[2 * m], vs[2 * m + 1], ir.Constant(ir.VectorType(i32, VW), hi)))
                      for m in range(len(vs) // 2)]
            res = builder.shuffle_vector(vs[0], vs[0], ir.Constant(ir.VectorType(i32, VW), _ORDER))
            sv = _splat(builder, scale, vf)
            builder.store(builder.fmul(res, sv), vec_at(ta[0], out_v, [(i0, ip)]), align=4)
        return context.get_dummy_value()
    return types.none(out, q, kb, slots, kh, nb, scale), codegen


def in_place(cache):
    """Whether attention reads the cache's rows where they lie (float32, float16 bits), not
    dequantized into a staging block (quantized blocks); compiled code only."""
    raise NotImplementedError


@overload(in_place, inline="always")
def _in_place(cache):
    flag = cache.dtype != types.uint8
    return lambda cache: flag


@numba.njit(**_JIT_ORDERED)  # reassociated, its sums came out differently compiled and cached (Intel, LLVM's rocketlake)
def _attend(q, k_cache, v_cache, t, kh0, kh1, group, seq, p_lo, p_hi, block_table, scale, softcap, block_size,
            pos, slopes, m, l, acc, kind_k, kind_v, rot_k):  # noqa: E741 (l: the sums, as the paper names them)
    """Online softmax of the query heads of token t (at position pos) of KV heads kh0..kh1-1 over
    positions p_lo..p_hi-1, less slopes[h] * |p - pos| where slopes is not empty (ALiBi):
    m (n_kv, group) running maxima, l (n_kv, group) sums of exp, acc (n_kv, group, dv)
    exp-weighted V; rows kh0..kh1-1 updated. Positions go ATT_BLOCK at a time (scores, then one
    max and rescale per block, then V); each K and V row read (a quantized one dequantized once)
    serves the head's whole GQA group, and a slot's heads are read together (its bytes are
    contiguous: per-head passes strode through memory at half the rate; a software prefetch
    of the next KV block measured no gain). rot_k > 0: K is stored rotated by H_rot_k, and so is
    each query row here (q.k unchanged: kvquant.fwht)."""
    d = q.shape[2]
    dv = acc.shape[2]
    nh = kh1 - kh0
    sc = np.empty((nh, group, ATT_BLOCK), np.float32)
    slots = np.empty(ATT_BLOCK, np.int64)
    # float caches are read in place (in_place: the staging copy was ~40% of attention's time at
    # 1,500 positions); quantized blocks are dequantized once into kb, vb for the whole GQA group
    direct_k, direct_v = in_place(k_cache) and d % VW == 0, in_place(v_cache)
    kb = np.empty((0 if direct_k else nh, ATT_BLOCK, d), np.float32)
    vb = np.empty((0 if direct_v else nh, ATT_BLOCK, dv), np.float32)
    dv_vec = dv // VW * VW
    qs = np.empty((nh, group, d), np.float32)
    for a in range(nh):
        for g in range(group):
            for j in range(d):
                qs[a, g, j] = q[t, (kh0 + a) * group + g, j]
            if rot_k > 0:
                fwht(qs[a, g], rot_k)
    blk = p_lo // block_size  # the slot walks the block table: no division per position
    off = p_lo - blk * block_size
    base = block_table[seq, blk] * block_size
    for p0 in range(p_lo, p_hi, ATT_BLOCK):
        nb = min(ATT_BLOCK, p_hi - p0)
        for i in range(nb):
            if off == block_size:
                blk += 1
                off = 0
                base = block_table[seq, blk] * block_size
            slots[i] = base + off
            off += 1
            if not direct_k:
                for a in range(nh):
                    load_row(k_cache[slots[i], kh0 + a], kb[a, i], kind_k)
        for a in range(nh):
            for g in range(group):
                if direct_k:
                    _dot_rows(sc[a, g], qs[a, g], k_cache, slots, kh0 + a, nb, scale)
                    continue
                if d % VW == 0:
                    _dot_rows(sc[a, g], qs[a, g], kb[a], slots, 0, nb, scale)
                    continue
                for i in range(nb):
                    s = np.float32(0.0)
                    for j in range(d):
                        s += qs[a, g, j] * kb[a, i, j]
                    sc[a, g, i] = s * scale
        if softcap > 0:  # as the unfused chain: scale by 1/softcap, tanh, scale by softcap
            inv = np.float32(1.0) / np.float32(softcap)
            for a in range(nh):
                for g in range(group):
                    for i in range(nb):
                        sc[a, g, i] = np.float32(np.tanh(sc[a, g, i] * inv)) * np.float32(softcap)
        if slopes.shape[0] > 0:  # ALiBi: as ggml's mask of -|p - pos| times the head's slope
            for a in range(nh):
                for g in range(group):
                    sl = slopes[(kh0 + a) * group + g]
                    for i in range(nb):
                        sc[a, g, i] += sl * np.float32(-abs(p0 + i - pos))
        for a in range(nh):
            kh = kh0 + a
            for g in range(group):
                mb = m[kh, g]
                for i in range(nb):
                    mb = max(mb, sc[a, g, i])
                if mb > m[kh, g]:  # rescale what was accumulated under the old maximum
                    corr = np.float32(math.exp(m[kh, g] - mb)) if m[kh, g] > -np.inf else np.float32(0.0)
                    l[kh, g] *= corr
                    for j in range(dv):
                        acc[kh, g, j] *= corr
                    m[kh, g] = mb
                for i in range(nb):  # apart from the sum: this loop vectorizes, one with an ordered sum does not
                    sc[a, g, i] = fexp(sc[a, g, i] - mb)
                ls = np.float32(0.0)
                for i in range(nb):
                    ls += sc[a, g, i]
                l[kh, g] += ls
        if not direct_v:
            for i in range(nb):
                for a in range(nh):
                    load_row(v_cache[slots[i], kh0 + a], vb[a, i], kind_v)
        for a in range(nh):
            for g in range(group):
                if direct_v:
                    _axpy_rows(acc[kh0 + a, g], sc[a, g], v_cache, slots, kh0 + a, nb)
                    for j in range(dv_vec, dv):  # past whole vectors
                        for i in range(nb):
                            acc[kh0 + a, g, j] += sc[a, g, i] * f32(v_cache[slots[i], kh0 + a, j])
                    continue
                _axpy_rows(acc[kh0 + a, g], sc[a, g], vb[a], slots, 0, nb)
                for j in range(dv_vec, dv):  # past whole vectors
                    for i in range(nb):
                        acc[kh0 + a, g, j] += sc[a, g, i] * vb[a, i, j]


@numba.njit(inline="always", **_JIT_ORDERED)
def _merge(job, n_head, group, first, pm, pl, pacc, sinks, out, rot_v):
    """Token t's head h from its parts' (max, sum, weighted V), in part order; rotated back by
    H_rot_v where V is stored rotated (rot_v > 0)."""
    t, h = job // n_head, job % n_head
    kh, g = h // group, h % group
    dv = out.shape[2]
    mx = np.float32(-np.inf)
    for part in range(first[t], first[t + 1]):
        mx = max(mx, pm[part, kh, g])
    if len(sinks):
        mx = max(mx, sinks[h])
    ls = np.float32(math.exp(sinks[h] - mx)) if len(sinks) else np.float32(0.0)
    for j in range(dv):
        out[t, h, j] = 0.0
    for part in range(first[t], first[t + 1]):
        w = np.float32(math.exp(pm[part, kh, g] - mx))
        ls += w * pl[part, kh, g]
        for j in range(dv):
            out[t, h, j] += w * pacc[part, kh, g, j]
    for j in range(dv):
        out[t, h, j] /= ls
    if rot_v > 0:
        fwht(out[t, h], rot_v)


@numba.njit(parallel=True, **_JIT_ORDERED)
def attention(q, k_cache, v_cache, tok_seq, tok_pos, tok_lo, tok_hi, block_table, scale, block_size, softcap, slopes,
              sinks, out, n_threads, kind_k=0, kind_v=0, rot_k=0, rot_v=0):
    """Flash-style attention with an online softmax: never holds a score matrix.
    q (n_tokens, n_head, d); caches (n_slots, n_head_kv, d_v), float32 or float16 bits (halfs),
    or blocks of types kind_k / kind_v (kvquant); out (n_tokens, n_head, d_v). rot_k, rot_v > 0:
    K and V stored rotated by Hadamard matrices of those sizes (core.kv_types' "+rot").
    Token t attends to positions tok_lo[t]..tok_hi[t] of its sequence (graph.attn_bounds); slopes
    (n_head,) float32: ALiBi's per-head slopes (graph.alibi_slopes), or empty for none; sinks
    (n_head,) float32: a logit per head in the softmax's denominator with no value (gpt-oss), or empty.
    A task per token and ATT_SPLIT positions of the token's context (its window), all KV heads
    (split into head ranges when the parts are too few for n_threads: heads never interact, so
    the results are the same); the parts' (max, sum, weighted V) are then merged per token in a
    fixed order."""
    n_tokens, n_head, d = q.shape
    n_kv = k_cache.shape[1]
    dv = out.shape[2]
    group = n_head // n_kv
    first = np.empty(n_tokens + 1, np.int64)  # token t's parts: first[t]..first[t+1]-1
    first[0] = 0
    for t in range(n_tokens):
        first[t + 1] = first[t] + (tok_hi[t] - tok_lo[t]) // ATT_SPLIT + 1
    n_parts = first[n_tokens]
    n_hr = min(n_kv, max(1, (2 * n_threads) // n_parts))  # head ranges a part
    pm = np.empty((n_parts, n_kv, group), np.float32)
    pl = np.empty((n_parts, n_kv, group), np.float32)
    pacc = np.empty((n_parts, n_kv, group, dv), np.float32)
    for job in prange(n_parts * n_hr):
        part, r = job // n_hr, job % n_hr
        kh0, kh1 = r * n_kv // n_hr, (r + 1) * n_kv // n_hr
        t = np.searchsorted(first, part, side="right") - 1
        p_lo = tok_lo[t] + (part - first[t]) * ATT_SPLIT
        pm[part, kh0:kh1] = -np.inf
        pl[part, kh0:kh1] = 0.0
        pacc[part, kh0:kh1] = 0.0
        _attend(q, k_cache, v_cache, t, kh0, kh1, group, tok_seq[t], p_lo, min(p_lo + ATT_SPLIT, tok_hi[t] + 1),
                block_table, scale, softcap, block_size, tok_pos[t], slopes, pm[part], pl[part], pacc[part],
                kind_k, kind_v, rot_k)
    if n_parts * n_head * dv < MERGE_PAR_MIN:  # decode: a second parallel region costs more than the merge
        for job in range(n_tokens * n_head):
            _merge(job, n_head, group, first, pm, pl, pacc, sinks, out, rot_v)
    else:
        for job in prange(n_tokens * n_head):
            _merge(job, n_head, group, first, pm, pl, pacc, sinks, out, rot_v)
