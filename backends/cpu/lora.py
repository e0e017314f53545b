"""LoRA adapters chosen per request (Op.LORA): each row's low-rank products, grouped by adapter.

A row's result must not depend on what else is in the batch (a request's output is bitwise the
same alone and beside others), so each row is computed on its own in one fixed order, whatever
the row count or the threads: x a as L running sums (input j into sum j mod L, L fixed), added
in order; then (x a) b, each output's sum in rank order. Both inner loops run across lanes (L
inputs, the outputs), so they vectorize without reordering any sum. The rows of one adapter share
its weights: each row of a, and of b a block at a time, is widened from F16 once for all of them
(the sums stay each row's own); ranges of rows spread over the threads. Not BLAS over a group: its
blocking follows the group's row count. No fastmath."""
from __future__ import annotations

import weakref

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from hearthlm.backends.cpu import dot, ops
from hearthlm.backends.cpu.halfs import VW, _call, _ptr, _splat, _vec_ptr, f32, widen
from hearthlm.backends.cpu.matmul import _matmul_n, _quantize1, matmul, quantize_for, start_pool
from hearthlm.backends.cpu.qtypes import PackedWeight
from hearthlm.core.graph import Op

L = 64  # lanes of x a's sums (a power of 2)
OB = 512  # outputs a block of (x a) b, for all the rows: a block of b's rows within L1-L2 (a multiple of W)


@intrinsic
def _lanes(typingctx, a, x, nb):
    """The first nb * L products a[j] * x[j], j into lane j mod L (fma, in order of j), the lanes then folded
    in halves (lane q + h into lane q, h = L/2 .. 1): lane 0. a: float32, or F16 bits. In registers (a lane's
    place in a vector does not change the sums: the same bits for 8- and 16-float vectors)."""
    def codegen(context, builder, sig, args):
        av, xv, nbv = args
        ta, ip = sig.args, types.intp
        cst = lambda v: context.get_constant(ip, v)  # noqa: E731
        vf = ir.VectorType(ir.FloatType(), VW)
        half = ta[0].dtype == types.uint16
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * VW)) for _ in range(L // VW)]
        with cgutils.for_range(builder, context.cast(builder, nbv, ta[2], ip)) as loop:
            base = builder.mul(loop.index, cst(L))
            for v, acc in enumerate(accs):
                off = [(builder.add(base, cst(v * VW)), ip)]
                w = (widen(builder, builder.load(_vec_ptr(context, builder, ta[0], av, off, ir.VectorType(ir.IntType(16), VW)),
                                                 align=2))
                     if half else builder.load(_vec_ptr(context, builder, ta[0], av, off, vf), align=4))
                xx = builder.load(_vec_ptr(context, builder, ta[1], xv, off, vf), align=4)
                builder.store(_call(builder, f"llvm.fma.v{VW}f32", vf, [w, xx, builder.load(acc)]), acc)
        vals = [builder.load(acc) for acc in accs]
        while len(vals) > 1:
            h = len(vals) // 2
            vals = [builder.fadd(vals[q], vals[q + h]) for q in range(h)]
        lanes = [builder.extract_element(vals[0], ir.Constant(ir.IntType(32), q)) for q in range(VW)]
        while len(lanes) > 1:
            h = len(lanes) // 2
            lanes = [builder.fadd(lanes[q], lanes[q + h]) for q in range(h)]
        return lanes[0]
    return types.float32(a, x, nb), codegen


NVB = 4  # vectors of outputs a chunk of (x a) b: W = NVB * VW outputs, in registers across the rank
W = NVB * 16  # (with 8-float vectors, two chunks' worth of registers: the same sums)


@intrinsic
def _bchunk(typingctx, b, t, q, y, yrow, o0, s):
    """y[yrow, o0:o0 + W] += s * sum over i of t[q, i] * b[i, o0:o0 + W] (fma, i in order; then times s, added).
    b: float32, or F16 bits."""
    def codegen(context, builder, sig, args):
        bv, tv, qv, yv, yrv, o0v, sv = args
        ta, ip = sig.args, types.intp
        cst = lambda v: context.get_constant(ip, v)  # noqa: E731
        vf = ir.VectorType(ir.FloatType(), VW)
        half = ta[0].dtype == types.uint16
        q, yr, o0 = (context.cast(builder, v, t_, ip) for v, t_ in ((qv, ta[2]), (yrv, ta[4]), (o0v, ta[5])))
        n_r = cgutils.unpack_tuple(builder, context.make_array(ta[0])(context, builder, bv).shape)[0]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * VW)) for _ in range(W // VW)]
        with cgutils.for_range(builder, n_r) as loop:
            i = loop.index
            ti = _splat(builder, builder.load(_ptr(context, builder, ta[1], tv, [(q, ip), (i, ip)])), vf)
            for v, acc in enumerate(accs):
                off = [(i, ip), (builder.add(o0, cst(v * VW)), ip)]
                w = (widen(builder, builder.load(_vec_ptr(context, builder, ta[0], bv, off, ir.VectorType(ir.IntType(16), VW)),
                                                 align=2))
                     if half else builder.load(_vec_ptr(context, builder, ta[0], bv, off, vf), align=4))
                builder.store(_call(builder, f"llvm.fma.v{VW}f32", vf, [w, ti, builder.load(acc)]), acc)
        sv_ = _splat(builder, context.cast(builder, sv, ta[6], types.float32), vf)
        for v, acc in enumerate(accs):
            p = _vec_ptr(context, builder, ta[3], yv, [(yr, ip), (builder.add(o0, cst(v * VW)), ip)], vf)
            builder.store(builder.fadd(builder.load(p, align=4), builder.fmul(builder.load(acc), sv_)), p, align=4)
        return context.get_dummy_value()
    return types.none(b, t, q, y, yrow, o0, s), codegen


@numba.njit(inline="always", cache=True, nogil=True)
def _cols(y, yrow, b, t, q, s, o0, o1):
    """y[yrow, o0:o1] += s * (t[q] b)[o0:o1]: whole chunks of W outputs (_bchunk), the outputs past the last
    whole chunk of the row in order (o0 on a chunk boundary; o1 one, or the row's end)."""
    o = o0
    while o + W <= o1:
        _bchunk(b, t, q, y, yrow, o, s)
        o += W
    for oo in range(o, o1):
        d = np.float32(0)
        for i in range(b.shape[0]):
            d += f32(b[i, oo]) * t[q, i]
        y[yrow, oo] += d * s


@numba.njit(inline="always", cache=True, nogil=True)
def _dot(ai, xt):
    """ai . xt: _lanes over the whole lanes' inputs, then the tail in order. ai: float32, or F16 bits."""
    nb = xt.shape[0] // L
    tot = _lanes(ai, xt, nb)
    for j in range(nb * L, xt.shape[0]):
        tot += f32(ai[j]) * xt[j]
    return tot


@numba.njit(inline="always", cache=True, nogil=True)
def _scale(sc, alpha, r):
    """A row's scale for an adapter of rank r: sc * alpha / r in float32 (alpha 0: sc), as llama.cpp's get_scale."""
    return np.float32(sc) if alpha == 0 else np.float32(np.float32(np.float32(sc) * np.float32(alpha)) / np.float32(r))


@numba.njit(inline="always", cache=True, nogil=True)
def _adapter(y, x, rows, nr, sc, alpha, a, b):
    """y[t] += s_t * ((a x[t]) b) for the nr rows t in rows, s_t = sc[q] * alpha / rank (alpha 0: sc[q]) in
    float32 as llama.cpp's get_scale; a (r, n_in) (the GGUF's lora_a), b (r, n_out): float32, or float16
    bits (uint16). A row's sums run in one order whatever nr is (_dot, _cols); several rows take b a block of
    OB outputs at a time, each block read once for all of them."""
    r, n_out = a.shape[0], y.shape[1]
    tmp = np.empty((nr, r), np.float32)
    for i in range(r):
        for q in range(nr):
            tmp[q, i] = _dot(a[i], x[rows[q]])
    s = np.empty(nr, np.float32)
    for q in range(nr):
        s[q] = _scale(sc[q], alpha, r)
    for o0 in range(0, n_out, OB):  # a block of b (in L1-L2) for all the rows
        for q in range(nr):
            _cols(y, rows[q], b, tmp, q, s[q], o0, min(o0 + OB, n_out))


@numba.njit(inline="always", cache=True, nogil=True)
def _part(y, x, s, cols, alphas, a_list, b_list, t0, t1, k0, k_step):
    """Rows t0..t1, adapters k0, k0 + k_step, ... in the node's order, each over those of the rows whose
    scale for it is not 0 (a row's adapters add up in order, in one thread)."""
    rows, sc = np.empty(t1 - t0, np.int64), np.empty(t1 - t0, np.float32)
    for k in range(k0, len(a_list), k_step):
        nr = 0
        for t in range(t0, t1):
            if s[t, cols[k]] != 0:
                rows[nr], sc[nr] = t, s[t, cols[k]]
                nr += 1
        if nr:
            _adapter(y, x, rows, nr, sc, alphas[k], a_list[k], b_list[k])


@numba.njit(parallel=True, cache=True, nogil=True)
def lora_rows(y, x, s, cols, alphas, a_list, b_list, n_parts):
    """_part on n_parts threads. y (n, n_out), x (n, n_in), s (n, S) float32; a_list, b_list: the
    adapters' matrices (a typed list, or a tuple of one). Where no row uses two of the node's adapters
    (a request has one, as usual), each thread takes every n_parts-th adapter over all rows: every
    adapter's weights are read once a step, where ranges of rows would have each thread read them all
    (they are cold: 17.6 MB an adapter at Qwen2.5-0.5B), where at least n_parts adapters are in use;
    else contiguous ranges of rows (one adapter's prompt: its rows over the threads)."""
    n = y.shape[0]
    one = True
    for t in range(n):
        used = 0
        for k in range(len(a_list)):
            used += s[t, cols[k]] != 0
        one = one and used <= 1
    n_used = 0
    for k in range(len(a_list)):
        for t in range(n):
            if s[t, cols[k]] != 0:
                n_used += 1
                break
    by_adapter = one and n_used >= n_parts
    for p in numba.prange(n_parts):
        if by_adapter:
            _part(y, x, s, cols, alphas, a_list, b_list, 0, n, p, n_parts)
        else:
            _part(y, x, s, cols, alphas, a_list, b_list, p * n // n_parts, (p + 1) * n // n_parts, 0, 1)


@numba.njit(cache=True, nogil=True)
def lora_rows_1(y, x, s, cols, alphas, a_list, b_list):
    """lora_rows on this thread (a separate function: numba's cache keys a function's code by its name,
    not by parallel=, so one function under both would load either's code for both)."""
    _part(y, x, s, cols, alphas, a_list, b_list, 0, y.shape[0], 0, 1)


# the same loops, so the same sums: threads for a step's worth of rows, one for a decoding row (a
# parallel region's start, ~20 us, costs more than its products, ~5-12 us at Qwen2.5-0.5B's shapes)
PAR_MIN_MACS = 1 << 19  # multiply-adds of a call from which it goes parallel (over rows)
# per node: the prepared weights' ids, and its adapters as the kernel takes them (made once: a node's
# prepared weights stay the same, and this runs ~170 times a decoded token)
_lists: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _values(w) -> np.ndarray:
    """A prepared adapter matrix as the kernel reads it: float32, or F16 as its uint16 bits (a
    narrow one is kept as a float32 array, a wide one packed "f32" or "half")."""
    if isinstance(w, PackedWeight):
        assert w.layout == "f32" or w.layout == "half" and w.ggml_type == 1, f"LoRA weights: {w.layout}"
        return w.w if w.layout == "f32" else w.qs
    return np.ascontiguousarray(w, np.float32)


def lora(node, y, x, s, *ab, out=None):
    """Op.LORA: y plus each adapter's products on its rows (into `out`, which may be y's buffer)."""
    n = y.shape[0]
    if out is None:
        out = np.array(y, np.float32, order="C")
    elif out is not y and not np.shares_memory(out, y):
        np.copyto(out, y)
    _on(_groups(node, ab), out.reshape(n, y.shape[-1]), np.ascontiguousarray(x, np.float32).reshape(n, x.shape[-1]),
        np.ascontiguousarray(s, np.float32))
    return out


def _groups(node, ab) -> list:
    """A LORA node's _make_groups, made on its first call and kept."""
    key = tuple(map(id, ab))
    hit = _lists.get(node)
    if hit is not None and hit[0] == key:
        return hit[1]
    groups = _make_groups(node.params["cols"], node.params["alphas"], ab)
    _lists[node] = (key, groups)  # ab's objects live as long as the node's graph: their ids stay theirs
    return groups


def _make_groups(cols, alphas, ab) -> list:
    """Adapters as the kernel takes them: one group per kind of array (float32 or F16 bits, read-only or
    not), in the given order; a group of one as a tuple (a typed list's unboxing costs ~2.5 us a call)."""
    values = [_values(w) for w in ab]
    by_kind: dict = {}
    for i, (col, alpha) in enumerate(zip(cols, alphas)):
        a, b = values[2 * i], values[2 * i + 1]
        by_kind.setdefault((a.dtype, b.dtype, a.flags.writeable, b.flags.writeable), []).append((col, alpha, a, b))
    groups = []
    for items in by_kind.values():
        a_list, b_list = (List([a for _, _, a, _ in items]), List([b for _, _, _, b in items])) if len(items) > 1 \
            else ((items[0][2],), (items[0][3],))
        groups.append((np.array([c for c, _, _, _ in items], np.int64), np.array([al for _, al, _, _ in items], np.float32),
                       a_list, b_list, sum(a.shape[0] * (a.shape[1] + b.shape[1]) for _, _, a, b in items)))
    return groups


def _on(groups, y2, x2, s2) -> None:
    """y2 (n, n_out) += the products of the adapters in `groups` (_groups), in place."""
    n = y2.shape[0]
    for cols, alphas, a_list, b_list, macs in groups:
        if n > 1 and n * macs >= PAR_MIN_MACS:
            lora_rows(y2, x2, s2, cols, alphas, a_list, b_list, min(n, numba.get_num_threads()))
        else:
            lora_rows_1(y2, x2, s2, cols, alphas, a_list, b_list)


# ---- a projection and its adapters in one node (MUL_MAT_LORA, MUL_MAT_ADD_LORA, FFN_GLU_LORA) ----
# One token (decode) is one compiled call: the product (threads over its rows, as matmul's), then the
# row's adapter (on the threads where big): the same sums as the batched kernels, so the same bits,
# without a node's walk step and Python call for each adapter product (168 a token at Qwen2.5-0.5B).

# an adapter's multiply-adds from which one row's products take the threads: q, k, v and o at Qwen2.5-0.5B
# too (1 << 16, gate, up and down only, measured 2% slower a decoded token)
PAR1_MIN_MACS = 1 << 14
OB_PAR = 256  # outputs a task of those


@numba.njit(parallel=True, cache=True, nogil=True)
def _three_par(x, y0, sc0, alpha0, a0, b0, y1, sc1, alpha1, a1, b1, y2, sc2, alpha2, a2, b2):
    """_adapter of one row for up to three adapters (each on its own output; sc 0: none) on the threads, in two
    parallel regions for all: their a's rows, then their b's columns; each sum runs as in _adapter, so the
    same bits."""
    r0, r1, r2 = a0.shape[0] if sc0 != 0 else 0, a1.shape[0] if sc1 != 0 else 0, a2.shape[0] if sc2 != 0 else 0
    t = np.empty((3, max(a0.shape[0], a1.shape[0], a2.shape[0])), np.float32)
    for k in numba.prange(r0 + r1 + r2):
        if k < r0:
            t[0, k] = _dot(a0[k], x[0])
        elif k < r0 + r1:
            t[1, k - r0] = _dot(a1[k - r0], x[0])
        else:
            t[2, k - r0 - r1] = _dot(a2[k - r0 - r1], x[0])
    s0, s1, s2 = _scale(sc0, alpha0, a0.shape[0]), _scale(sc1, alpha1, a1.shape[0]), _scale(sc2, alpha2, a2.shape[0])
    w0, w1, w2 = y0.shape[1], y1.shape[1], y2.shape[1]
    n0 = (w0 + OB_PAR - 1) // OB_PAR if r0 else 0
    n1 = (w1 + OB_PAR - 1) // OB_PAR if r1 else 0
    n2 = (w2 + OB_PAR - 1) // OB_PAR if r2 else 0
    for k in numba.prange(n0 + n1 + n2):
        if k < n0:
            _cols(y0, 0, b0, t, 0, s0, k * OB_PAR, min(k * OB_PAR + OB_PAR, w0))
        elif k < n0 + n1:
            o = (k - n0) * OB_PAR
            _cols(y1, 0, b1, t, 1, s1, o, min(o + OB_PAR, w1))
        else:
            o = (k - n0 - n1) * OB_PAR
            _cols(y2, 0, b2, t, 2, s2, o, min(o + OB_PAR, w2))


@numba.njit(inline="always", cache=True, nogil=True)
def _three(x, y0, sc0, alpha0, a0, b0, y1, sc1, alpha1, a1, b1, y2, sc2, alpha2, a2, b2):
    """Up to three adapters of one row, each on its own output: on the threads where any is big."""
    big = 0
    if sc0 != 0:
        big = max(big, a0.shape[0] * (a0.shape[1] + b0.shape[1]))
    if sc1 != 0:
        big = max(big, a1.shape[0] * (a1.shape[1] + b1.shape[1]))
    if sc2 != 0:
        big = max(big, a2.shape[0] * (a2.shape[1] + b2.shape[1]))
    if big >= PAR1_MIN_MACS:
        _three_par(x, y0, sc0, alpha0, a0, b0, y1, sc1, alpha1, a1, b1, y2, sc2, alpha2, a2, b2)
    elif big:
        _one(y0, x, sc0, alpha0, a0, b0)
        _one(y1, x, sc1, alpha1, a1, b1)
        _one(y2, x, sc2, alpha2, a2, b2)


@numba.njit(inline="always", cache=True, nogil=True)
def _one(y, x, sc, alpha, a, b):
    """_adapter of one row and one adapter (sc 0: none), a big one on the threads."""
    if sc != 0:
        if a.shape[0] * (a.shape[1] + b.shape[1]) >= PAR1_MIN_MACS:
            _three_par(x, y, sc, alpha, a, b, y[:, :0], 0.0, 0.0, a, b, y[:, :0], 0.0, 0.0, a, b)
        else:
            _adapter(y, x, np.zeros(1, np.int64), 1, np.full(1, np.float32(sc)), np.float32(alpha), a, b)


# The adapter of the row as arrays and floats: a tuple or typed list argument costs numba's dispatch
# microseconds to type and unbox (~12 us a call for the FFN's four)

@numba.njit(cache=True, nogil=True)
def matvec_lora(tag, qs, d, m, sup, ms, c, sub, x, y, sc, alpha, a, b):
    _matmul_n(tag, qs, d, m, sup, ms, c, sub, x, y)
    _one(y, x, sc, alpha, a, b)


@numba.njit(cache=True, nogil=True)
def matvec_lora3(tag, qs, d, m, sup, ms, c, sub, x, y, c0, c1, sc0, alpha0, a0, b0, c2, sc1, alpha1, a1, b1,
                 c3, sc2, alpha2, a2, b2):
    """Stacked weights (q, k and v) and each one's adapter on its columns [c0, c1), [c1, c2), [c2, c3) (the third
    empty for two)."""
    _matmul_n(tag, qs, d, m, sup, ms, c, sub, x, y)
    _three(x, y[:, c0:c1], sc0, alpha0, a0, b0, y[:, c1:c2], sc1, alpha1, a1, b1, y[:, c2:c3], sc2, alpha2, a2, b2)


@numba.njit(cache=True, nogil=True)
def matvec_add_lora(tag, qs, d, m, sup, ms, c, sub, x, r, y, sc, alpha, a, b):
    t = np.empty(y.shape, np.float32)  # y may be r's buffer
    _matmul_n(tag, qs, d, m, sup, ms, c, sub, x, t)
    _one(t, x, sc, alpha, a, b)
    for j in range(y.shape[1]):
        y[0, j] = t[0, j] + r[0, j]


@numba.njit(cache=True, nogil=True)
def ffn_glu1_lora(tag, qg, dg, mg, sg, msg, cg, qu, du, mu, su, msu, cu, sub, x, gelu, out,
                  sc_g, alpha_g, a_g, b_g, sc_u, alpha_u, a_u, b_u):
    xq, xd, xs = _quantize1(x, dg.shape[1] * sub, sub)  # once for gate and up
    g = np.empty(out.shape, np.float32)
    u = np.empty(out.shape, np.float32)
    dot.dot_any(tag, qg, dg, mg, sg, msg, cg, xq, xd, xs, g)
    dot.dot_any(tag, qu, du, mu, su, msu, cu, xq, xd, xs, u)
    _three(x, g, sc_g, alpha_g, a_g, b_g, u, sc_u, alpha_u, a_u, b_u, u[:, :0], 0.0, 0.0, a_u, b_u)
    ops.glu_1(g, u, gelu, out)


def _packed(w) -> tuple:
    return dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, w.sub


def _product(w, x2, xq=None, out=None):
    """x2 @ w.T for a packed weight, or a float32 one narrower than a quant block."""
    if isinstance(w, PackedWeight):
        return matmul(w, x2, out, xq=xq)
    return np.matmul(x2, w.T, out=out)


def bind_proj_lora(node):
    """The CPU kernel of a MUL_MAT_LORA, MUL_MAT_ADD_LORA or FFN_GLU_LORA node (sources as lora_split names
    them). What one token's compiled call takes of the weights and adapters is made on the first call and
    kept (a bound node's weights stay the same): ~140 of these run a decoded token."""
    op, nb = node.op, 2 if node.op is Op.MUL_MAT_LORA else 3
    spans, i = [], nb + 1
    for cols, _ in node.params["parts"]:
        spans.append((i, i + 2 * len(cols)))
        i += 2 * len(cols)
    gelu = node.params.get("act") == "gelu"
    n_out, xi = node.shape[-1], 2 if op is Op.FFN_GLU_LORA else 1
    out_cols = node.params.get("out_cols")  # a MUL_MAT_LORA over stacked weights: each part's columns
    if out_cols is not None:
        ends = [o0 for o0, _ in out_cols] + [out_cols[-1][1]] * (4 - len(out_cols))
    memo: list = [None, None, None]  # (the weight and first adapter it was made for), one_token's, each part's groups

    def one_token(values):
        """What the compiled one-token call takes: the weight's arguments and each part's adapters as
        (scales column, alpha, a, b); None where its kernels do not apply."""
        ws = values[:2] if op is Op.FFN_GLU_LORA else values[:1]
        if not all(isinstance(w, PackedWeight) and w.kind >= 0 for w in ws):
            return None
        parts = [[(c, al, _values(values[a + 2 * j]), _values(values[a + 2 * j + 1]))
                  for j, (c, al) in enumerate(zip(*node.params["parts"][p]))] for p, (a, _) in enumerate(spans)]
        if op is not Op.FFN_GLU_LORA:
            return (_packed(ws[0]), parts) if out_cols is None or len(parts) <= 3 else None
        wg, wu = ws
        if (wg.kind, wg.n_pad, wg.sub) != (wu.kind, wu.n_pad, wu.sub) or not all(parts):
            return None
        return (*_packed(wg)[:7], *_packed(wu)[1:7], wg.sub), parts

    def row_adapters(parts, row):
        """Each part's one adapter of the row as (scale, alpha, a, b), scale 0 for none; None if it uses two."""
        out = []
        for pairs in parts:
            on = [(row[c], al, a, b) for c, al, a, b in pairs if row[c] != 0]
            if len(on) > 1:
                return None
            out += on[0] if on else (0.0, 0.0, pairs[0][2], pairs[0][3])
        return out

    def k(*values, out=None):
        if memo[0] is None or memo[0][0] is not values[0] or memo[0][1] is not values[nb + 1]:
            memo[:] = [(values[0], values[nb + 1]), one_token(values),
                       [_make_groups(*node.params["parts"][p], values[a:b]) for p, (a, b) in enumerate(spans)]]
        x = values[xi]
        x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), np.float32)
        s2 = np.ascontiguousarray(values[nb], np.float32)
        n, fast = x2.shape[0], memo[1]
        ads = row_adapters(fast[1], s2[0].tolist()) if n == 1 and fast is not None else None
        if ads is not None:
            start_pool()
            o = np.empty((1, n_out), np.float32) if out is None else out.reshape(1, n_out)
            if out_cols is not None:
                ads += [0.0, 0.0, ads[2], ads[3]] * (3 - len(out_cols))  # an empty third: no adapter
                matvec_lora3(*fast[0], x2, o, *ends[:2], *ads[:4], ends[2], *ads[4:8], ends[3], *ads[8:])
            elif op is Op.MUL_MAT_LORA:
                matvec_lora(*fast[0], x2, o, *ads)
            elif op is Op.MUL_MAT_ADD_LORA:
                matvec_add_lora(*fast[0], x2, np.ascontiguousarray(values[2], np.float32).reshape(1, n_out), o, *ads)
            else:
                ffn_glu1_lora(*fast[0], x2, gelu, o, *ads)
            return o.reshape(node.shape) if out is None else out
        groups = memo[2]
        if op is Op.FFN_GLU_LORA:
            w, wu = values[0], values[1]
            xq = quantize_for(w, x2) if isinstance(w, PackedWeight) and w.kind >= 0 and n else None
            g, u = _product(w, x2, xq), _product(wu, x2, xq)
            _on(groups[0], g, x2, s2)
            _on(groups[1], u, x2, s2)
            o = (np.empty(node.shape, np.float32) if out is None else out).reshape(n, n_out)
            ops.glu(g, u, gelu, o)
            return o.reshape(node.shape) if out is None else out
        if op is Op.MUL_MAT_LORA:
            o = (np.empty(node.shape, np.float32) if out is None else out).reshape(n, n_out)
            _product(values[0], x2, out=o)
            for g, (o0, o1) in zip(groups, out_cols or ((0, n_out),)):
                _on(g, o[:, o0:o1], x2, s2)
            return o.reshape(node.shape) if out is None else out
        r = values[2]
        t = _product(values[0], x2)
        _on(groups[0], t, x2, s2)
        return np.add(t.reshape(r.shape), r, out=out)
    return k
