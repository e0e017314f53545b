"""The fused gated FFN on the CPU: act(x @ Wg.T) * (x @ Wu.T) one slab of output columns
at a time, so gate and up never exist whole: each slab's two matmul results are small
(n_tokens x CHUNK), consumed by the GLU at once and overwritten by the next slab."""
from __future__ import annotations

import weakref

import numpy as np

from hearthlm.backends.cpu import dot, ops
from hearthlm.backends.cpu.matmul import BLAS_MIN_TOKENS, ffn_glu_n, matmul, quantize_for, start_pool
from hearthlm.backends.cpu.qtypes import PackedWeight
from hearthlm.backends.cpu.replay import call

CHUNK = 512  # output columns per slab: a multiple of matmul.TILE_ROWS
WHOLE_MAX = 1 << 19  # up to this many outputs (n_tokens x n_ff), one slab: slabs cost a call each (64 tokens
# of Qwen2.5-0.5B whole: 5.35 ms against 5.61 in slabs)

_slabs: "weakref.WeakKeyDictionary[PackedWeight, list[PackedWeight]]" = weakref.WeakKeyDictionary()


def _row_slabs(w: PackedWeight, chunk: int) -> list[PackedWeight]:
    """Row ranges of a packed weight as PackedWeights (views, no copies), made once."""
    got = _slabs.get(w)
    if got is None or got[0].shape[0] != min(chunk, w.shape[0]):
        got = _slabs[w] = [w.rows(r0, r0 + chunk) for r0 in range(0, w.shape[0], chunk)]
    return got


def ffn_glu(wg: PackedWeight, wu: PackedWeight, x: np.ndarray, gelu: bool, out: np.ndarray,
            chunk: int = CHUNK) -> np.ndarray:
    """x (n_tokens, n_embd) -> out (n_tokens, n_ff) = act(x Wg^T) * (x Wu^T)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1, wg.shape[1])
    o = out.reshape(x.shape[0], wg.shape[0])
    n, same = x.shape[0], wg.kind >= 0 and (wg.kind, wg.n_pad, wg.sub) == (wu.kind, wu.n_pad, wu.sub)
    if same and (n == 1 or n * wg.shape[0] <= WHOLE_MAX and n < BLAS_MIN_TOKENS):
        start_pool()  # decode: gate/up are a few KB, calls are the cost; one recorded call
        call(ffn_glu_n, dot.TAGS[wg.kind], wg.qs, wg.d, wg.m, wg.sup, wg.ms, wg.c32, wu.qs, wu.d, wu.m, wu.sup,
             wu.ms, wu.c32, wg.sub, x, gelu, o)
        return out
    if n * wg.shape[0] <= WHOLE_MAX:
        chunk = wg.shape[0]
    r0 = 0
    xq = quantize_for(wg, x)  # once for all slabs of gate and up
    for g_w, u_w in zip(_row_slabs(wg, chunk), _row_slabs(wu, chunk)):
        r1 = r0 + g_w.shape[0]
        g = matmul(g_w, x, xq=xq)  # (n_tokens, r1 - r0)
        ops.glu(g, matmul(u_w, x, xq=xq), gelu, g)
        o[:, r0:r1] = g
        r0 = r1
    return out
