"""LoRA adapters chosen per request (Op.LORA): each row's low-rank products, grouped by adapter.

A row's result must not depend on what else is in the batch (a request's output is bitwise the
same alone and beside others), so each row is computed on its own in one fixed order, whatever
the row count or the threads: x a as L running sums (input j into sum j mod L, L fixed), added
in order; then (x a) b, each output's sum in rank order. Both inner loops run across lanes (L
inputs, the outputs), so they vectorize without reordering any sum; rows spread over the
threads. Not BLAS over a group: its blocking follows the group's row count. No fastmath."""
from __future__ import annotations

import weakref

import numba
import numpy as np
from numba.typed import List

from hearthlm.backends.cpu.halfs import f32
from hearthlm.backends.cpu.qtypes import PackedWeight

L = 128  # lanes of x a's sums


@numba.njit(inline="always", cache=True, nogil=True)
def _add_row(yt, xt, sc, alpha, a, b, acc, d):
    """yt += s * ((a xt) b), s = sc * alpha / rank (alpha 0: sc) in float32 as llama.cpp's get_scale;
    a (r, n_in) (the GGUF's lora_a), b (r, n_out): float32, or float16 bits (uint16), widened as read."""
    r, n_in = a.shape
    nb = n_in // L
    if alpha != 0:
        sc = np.float32(np.float32(sc * alpha) / np.float32(r))
    tmp = np.empty(r, np.float32)
    for i in range(r):
        ai = a[i]
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
        tmp[i] = tot
    d[:] = 0
    for i in range(r):
        ti, bi = tmp[i], b[i]
        for o in range(d.shape[0]):
            d[o] += f32(bi[o]) * ti
    for o in range(d.shape[0]):
        yt[o] += d[o] * sc


@numba.njit(parallel=True, cache=True, nogil=True)
def lora_rows(y, x, s, cols, alphas, a_list, b_list):
    """For each row t, each adapter i in order whose scale s[t, cols[i]] is not 0 (_add_row). y (n, n_out),
    x (n, n_in), s (n, S) float32; a_list, b_list: the adapters' matrices. One task a row: a row's
    adapters add up in one thread, in order."""
    for t in numba.prange(y.shape[0]):
        _adapters_row(y, x, s, cols, alphas, a_list, b_list, t)


@numba.njit(cache=True, nogil=True)
def lora_rows_1(y, x, s, cols, alphas, a_list, b_list):
    """lora_rows on this thread (a separate function: numba's cache keys a function's code by its name,
    not by parallel=, so one function under both would load either's code for both)."""
    for t in range(y.shape[0]):
        _adapters_row(y, x, s, cols, alphas, a_list, b_list, t)


@numba.njit(inline="always", cache=True, nogil=True)
def _adapters_row(y, x, s, cols, alphas, a_list, b_list, t):
    acc, d = np.empty(L, np.float32), np.empty(y.shape[1], np.float32)
    for i in range(len(a_list)):
        if s[t, cols[i]] != 0:
            _add_row(y[t], x[t], s[t, cols[i]], alphas[i], a_list[i], b_list[i], acc, d)


@numba.njit(parallel=True, cache=True, nogil=True)
def lora_one(y, x, s, col, alpha, a, b):
    """lora_rows for one adapter, its matrices as arrays (a typed list's unboxing costs ~10 us a call)."""
    for t in numba.prange(y.shape[0]):
        _one_row(y, x, s, col, alpha, a, b, t)


@numba.njit(cache=True, nogil=True)
def lora_one_1(y, x, s, col, alpha, a, b):
    for t in range(y.shape[0]):
        _one_row(y, x, s, col, alpha, a, b, t)


@numba.njit(inline="always", cache=True, nogil=True)
def _one_row(y, x, s, col, alpha, a, b, t):
    if s[t, col] != 0:
        _add_row(y[t], x[t], s[t, col], alpha, a, b, np.empty(L, np.float32), np.empty(y.shape[1], np.float32))


# the same loops, so the same sums: threads for a step's worth of rows, one for a decoding row (a
# parallel region's start, ~20 us, costs more than its products, ~5-12 us at Qwen2.5-0.5B's shapes)
PAR_MIN_MACS = 1 << 19  # multiply-adds of a call from which it goes parallel (over rows)
# per node: its adapters' matrices as numba typed lists (made once; the prepared weights stay the same)
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
    elif not np.shares_memory(out, y):
        np.copyto(out, y)
    o2 = out.reshape(n, y.shape[-1])
    x2 = np.ascontiguousarray(x, np.float32).reshape(n, x.shape[-1])
    s2 = np.ascontiguousarray(s, np.float32)
    for cols, alphas, a_list, b_list, macs in _groups(node, ab):
        par = n > 1 and n * macs >= PAR_MIN_MACS
        if len(a_list) == 1:
            (lora_one if par else lora_one_1)(o2, x2, s2, cols[0], alphas[0], a_list[0], b_list[0])
        else:
            (lora_rows if par else lora_rows_1)(o2, x2, s2, cols, alphas, a_list, b_list)
    return out


def _groups(node, ab) -> list:
    """The node's adapters as the kernel takes them, made on its first call: one group per kind of
    array (float32 or F16 bits; adapters of one kind each), in the node's order."""
    values = [_values(w) for w in ab]
    key = tuple(id(v) for v in values)
    hit = _lists.get(node)
    if hit is not None and hit[0] == key:
        return hit[1]
    by_kind: dict = {}
    for i, (col, alpha) in enumerate(zip(node.params["cols"], node.params["alphas"])):
        a, b = values[2 * i], values[2 * i + 1]
        by_kind.setdefault((a.dtype, b.dtype, a.flags.writeable, b.flags.writeable), []).append((col, alpha, a, b))
    groups = []
    for items in by_kind.values():
        a_list, b_list = (List(), List()) if len(items) > 1 else ([], [])
        for _, _, a, b in items:
            a_list.append(a)
            b_list.append(b)
        groups.append((np.array([c for c, _, _, _ in items], np.int64), np.array([al for _, al, _, _ in items], np.float32),
                       a_list, b_list, sum(a.shape[0] * (a.shape[1] + b.shape[1]) for _, _, a, b in items)))
    _lists[node] = (key, groups)
    return groups
