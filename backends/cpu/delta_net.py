"""numba kernel of the gated delta rule (Qwen3-Next / Qwen3.5 linear attention, ggml's
GATED_DELTA_NET): one task per (sequence row, v-head), whose tokens run in order inside
compiled code, decode and prefill alike. The rule leaves the rows of a head's state (value
dims) independent of each other, so each token is one pass over the state, row by row: S k
in one sweep of the row, then the decay, the update and S q in a second (the row is in L1 by
then); the head's d_v x d_k state stays in L2 across the tokens. Float32 throughout, as ggml.
No chunked (WY) form: at d = 128 and chunks of 64 it does ~1.3x this form's flops, and tiling
tokens per row (a row kept in L1 across 32 tokens) measured slower than this plain order."""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from .fpmode import flush_subnormals, restore_mode
from .ops import _JIT


@numba.njit(inline="always", **_JIT)
def _head(state, q, k, v, g, beta, seq_off, state_slot, snap, scale, out, job):
    """Row i = job // H_v's tokens through v-head h = job % H_v, in place on its state."""
    n_heads = v.shape[1]
    i, h = job // n_heads, job % n_heads
    t0, t1 = seq_off[i], seq_off[i + 1]
    if t1 <= t0:
        return  # no tokens: the slot is not touched (nor its index read)
    kh = h % q.shape[1]  # tiled, as ggml (ops.cpp: iq1 = iv1 % neq1), not GQA's h // group
    s = state[state_slot[i], h]  # (d_v, d_k): row j is value dim j
    d_v, d_k = s.shape
    mode = flush_subnormals()  # each k and q component is multiplied d_v times a token (see fpmode)
    for t in range(t0, t1):
        a, b = np.float32(math.exp(g[t, h])), beta[t, h]
        kt, qt = k[t, kh], q[t, kh]
        for j in range(d_v):
            kv = np.float32(0.0)
            for c in range(d_k):
                kv += s[j, c] * kt[c]
            delta = (v[t, h, j] - a * kv) * b  # S k after the decay (a S k), as ggml's cuda kernel
            o = np.float32(0.0)
            for c in range(d_k):
                x = a * s[j, c] + delta * kt[c]
                s[j, c] = x
                o += x * qt[c]
            out[t, h, j] = o * scale
        if snap.shape[0] > 0 and snap[t] >= 0:  # the state after t (a drafted position's)
            state[snap[t], h] = s
    restore_mode(mode)


@numba.njit(parallel=True, **_JIT)
def gated_delta_net(state, q, k, v, g, beta, seq_off, state_slot, snap, scale, out):
    """state (S, H_v, d_v, d_k) float32, updated in place; q, k (n, H_k, d_k), v, out
    (n, H_v, d_v), g, beta (n, H_v); seq_off (n_seqs+1,), state_slot (n_seqs,); snap (n,) or
    empty: where snap[t] >= 0 the state after token t is also copied there. Writes the rows'
    tokens of out only (the caller zeroes padding)."""
    for job in prange(state_slot.shape[0] * v.shape[1]):
        _head(state, q, k, v, g, beta, seq_off, state_slot, snap, np.float32(scale), out, job)


@numba.njit(**_JIT)
def gated_delta_net_1(state, q, k, v, g, beta, seq_off, state_slot, snap, scale, out):
    for job in range(state_slot.shape[0] * v.shape[1]):
        _head(state, q, k, v, g, beta, seq_off, state_slot, snap, np.float32(scale), out, job)
