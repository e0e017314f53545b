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
from numba.typed import List

from hearthlm.backends.cpu.halfs import f32
from hearthlm.backends.cpu.qtypes import PackedWeight

L = 128  # lanes of x a's sums
OB = 512  # outputs a block of (x a) b: a block of b's rows and of the rows' sums within L1


@numba.njit(inline="always", cache=True, nogil=True)
def _dot(ai, xt, acc):
    """ai . xt: input j into lane j mod L, lanes added in order, then the tail. ai: float32, or F16 bits."""
    n_in = xt.shape[0]
    nb = n_in // L
    acc[:] = 0
    for jb in range(nb):
        seg, xs = ai[jb * L:(jb + 1) * L], xt[jb * L:(jb + 1) * L]
        for q in range(L):
            acc[q] += f32(seg[q]) * xs[q]
    tot = np.float32(0)
    for q in range(L):
        tot += acc[q]
    for j in range(nb * L, n_in):
        tot += f32(ai[j]) * xt[j]
    return tot


@numba.njit(inline="always", cache=True, nogil=True)
def _widen(src, dst):
    for o in range(dst.shape[0]):
        dst[o] = f32(src[o])


@numba.njit(inline="always", cache=True, nogil=True)
def _adapter(y, x, rows, nr, sc, alpha, a, b, acc, abuf):
    """y[t] += s_t * ((a x[t]) b) for the nr rows t in rows, s_t = sc[q] * alpha / rank (alpha 0: sc[q]) in
    float32 as llama.cpp's get_scale; a (r, n_in) (the GGUF's lora_a), b (r, n_out): float32, or float16
    bits (uint16). A row's sums run in one order whatever nr is; for several rows each row of a, and b a
    block of OB outputs at a time, is widened once for all of them (into abuf, bbuf (r, OB))."""
    r, n_out = a.shape[0], y.shape[1]
    tmp = np.empty((nr, r), np.float32)
    for i in range(r):
        if nr == 1:
            tmp[0, i] = _dot(a[i], x[rows[0]], acc)
        else:
            _widen(a[i], abuf)
            for q in range(nr):
                tmp[q, i] = _dot(abuf, x[rows[q]], acc)
    s = np.empty(nr, np.float32)
    for q in range(nr):
        s[q] = sc[q] if alpha == 0 else np.float32(np.float32(sc[q] * alpha) / np.float32(r))
    ob = n_out if nr == 1 else OB  # one row reads b whole, a row after another (a stream the prefetcher follows)
    d, bbuf = np.empty(ob, np.float32), np.empty((r if nr > 1 else 0, ob), np.float32)
    for o0 in range(0, n_out, ob):
        w = min(ob, n_out - o0)
        if nr > 1:
            for i in range(r):
                _widen(b[i, o0:o0 + w], bbuf[i, :w])
        for q in range(nr):
            d[:w] = 0
            for i in range(r):
                ti = tmp[q, i]
                if nr == 1:
                    bi = b[i, o0:o0 + w]
                    for o in range(w):
                        d[o] += f32(bi[o]) * ti
                else:
                    bi = bbuf[i]
                    for o in range(w):
                        d[o] += bi[o] * ti
            yt, sq = y[rows[q], o0:o0 + w], s[q]
            for o in range(w):
                yt[o] += d[o] * sq


@numba.njit(inline="always", cache=True, nogil=True)
def _part(y, x, s, cols, alphas, a_list, b_list, t0, t1, k0, k_step):
    """Rows t0..t1, adapters k0, k0 + k_step, ... in the node's order, each over those of the rows whose
    scale for it is not 0 (a row's adapters add up in order, in one thread)."""
    rows, sc = np.empty(t1 - t0, np.int64), np.empty(t1 - t0, np.float32)
    acc = np.empty(L, np.float32)
    abuf = np.empty(x.shape[1], np.float32)
    for k in range(k0, len(a_list), k_step):
        nr = 0
        for t in range(t0, t1):
            if s[t, cols[k]] != 0:
                rows[nr], sc[nr] = t, s[t, cols[k]]
                nr += 1
        if nr:
            _adapter(y, x, rows, nr, sc, alphas[k], a_list[k], b_list[k], acc, abuf)


@numba.njit(parallel=True, cache=True, nogil=True)
def lora_rows(y, x, s, cols, alphas, a_list, b_list, n_parts):
    """_part on n_parts threads. y (n, n_out), x (n, n_in), s (n, S) float32; a_list, b_list: the
    adapters' matrices (a typed list, or a tuple of one). Where no row uses two of the node's adapters
    (a request has one, as usual), each thread takes every n_parts-th adapter over all rows: every
    adapter's weights are read once a step, where ranges of rows would have each thread read them all
    (they are cold: 17.6 MB an adapter at Qwen2.5-0.5B); else contiguous ranges of rows."""
    n = y.shape[0]
    one = True
    for t in range(n):
        used = 0
        for k in range(len(a_list)):
            used += s[t, cols[k]] != 0
        one = one and used <= 1
    by_adapter = one and len(a_list) > 1
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
    o2 = out.reshape(n, y.shape[-1])
    x2 = np.ascontiguousarray(x, np.float32).reshape(n, x.shape[-1])
    s2 = np.ascontiguousarray(s, np.float32)
    for cols, alphas, a_list, b_list, macs in _groups(node, ab):
        if n > 1 and n * macs >= PAR_MIN_MACS:
            lora_rows(o2, x2, s2, cols, alphas, a_list, b_list, min(n, numba.get_num_threads()))
        else:
            lora_rows_1(o2, x2, s2, cols, alphas, a_list, b_list)
    return out


def _groups(node, ab) -> list:
    """The node's adapters as the kernel takes them, made on its first call: one group per kind of
    array (float32 or F16 bits, read-only or not), in the node's order; a group of one as a tuple (a
    typed list's unboxing costs ~2.5 us a call)."""
    key = tuple(map(id, ab))
    hit = _lists.get(node)
    if hit is not None and hit[0] == key:
        return hit[1]
    values = [_values(w) for w in ab]
    by_kind: dict = {}
    for i, (col, alpha) in enumerate(zip(node.params["cols"], node.params["alphas"])):
        a, b = values[2 * i], values[2 * i + 1]
        by_kind.setdefault((a.dtype, b.dtype, a.flags.writeable, b.flags.writeable), []).append((col, alpha, a, b))
    groups = []
    for items in by_kind.values():
        a_list, b_list = (List([a for _, _, a, _ in items]), List([b for _, _, _, b in items])) if len(items) > 1 \
            else ((items[0][2],), (items[0][3],))
        groups.append((np.array([c for c, _, _, _ in items], np.int64), np.array([al for _, al, _, _ in items], np.float32),
                       a_list, b_list, sum(a.shape[0] * (a.shape[1] + b.shape[1]) for _, _, a, b in items)))
    _lists[node] = (key, groups)  # ab's objects live as long as the node's graph: their ids stay theirs
    return groups
