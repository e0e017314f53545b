"""numba kernels of the recurrent (hybrid-model) layers: the short causal convolution (SSM_CONV)
and Mamba-2's selective scan (SSM_SCAN) over a batch of sequence rows, each running its tokens
in order from its state slot and leaving the state after them there; and the row and
elementwise ops those layers use (L2_NORM, SIGMOID, SOFTPLUS). A batch is one compiled call:
tasks are sequence rows (the conv) or (sequence row, head) pairs, never a Python loop per token.
The state arrays are float32 and updated in place; a row with no tokens leaves its slot alone.
`snap` (n,) int32, or empty for none: where snap[t] >= 0, the state after token t is also
copied to slot snap[t] (speculative verification rows: the state after each drafted position)."""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from .fpmode import flush_subnormals, restore_mode
from .ops import _JIT, fexp


@numba.njit(inline="always", **_JIT)
def _conv_task(state, x, w_t, seq_off, state_slot, snap, y, i, c0, c1):
    """Row i's tokens over channels c0..c1. xx = [state[slot] (K-1 rows); x[t0:t1]] is read in
    place (row r of xx: the state's below K-1, else a token's); w_t is the kernel as (K, C)."""
    km1 = state.shape[1]
    t0, t1 = seq_off[i], seq_off[i + 1]
    s = state[state_slot[i]]
    for t in range(t0, t1):
        for c in range(c0, c1):
            y[t, c] = 0.0
        for k in range(km1 + 1):
            r = t - t0 + k
            row = s[r] if r < km1 else x[t0 + r - km1]
            for c in range(c0, c1):
                y[t, c] += w_t[k, c] * row[c]
        if snap.shape[0] > 0 and snap[t] >= 0:  # the state after t: xx's rows t - t0 + 1 .. t - t0 + K-1
            d = state[snap[t]]
            for r in range(km1):
                q = t - t0 + 1 + r
                row = s[q] if q < km1 else x[t0 + q - km1]
                for c in range(c0, c1):
                    d[r, c] = row[c]
    # the state becomes xx's last K-1 rows; ascending, row r reads row L + r > r, not yet written
    n = t1 - t0
    if n > 0:
        for r in range(km1):
            q = n + r
            row = s[q] if q < km1 else x[t0 + q - km1]
            for c in range(c0, c1):
                s[r, c] = row[c]


@numba.njit(**_JIT)
def ssm_conv(state, x, w_t, seq_off, state_slot, snap, y):
    """state (S, K-1, C), x (n, C), w_t (K, C), seq_off (n_seqs+1,), state_slot (n_seqs,), snap; y (n, C)
    for the tokens in a range (padding rows are the caller's). Serial: a prange over (row, channel
    block) measured 5x slower at 16 decode rows and 3x at a 512-token prompt (6144 channels, 2
    cores); the work is a few MACs per value, memory-bound either way."""
    for i in range(state_slot.shape[0]):
        _conv_task(state, x, w_t, seq_off, state_slot, snap, y, i, 0, x.shape[1])


@numba.njit(inline="always", **_JIT)
def _softplus(v):
    """ggml_compute_softplus_f32: x where x > 20, else log(1 + exp(x))."""
    return v if v > np.float32(20.0) else np.float32(math.log1p(math.exp(v)))


@numba.njit(parallel=True, **_JIT)
def ssm_scan(state, x, dt, a, b, c, seq_off, state_slot, snap, y):
    """state (S, H, P, N), x (n, H, P), dt (n, H), a (H,), b and c (n, G, N), y (n, H, P).
    As ggml_compute_forward_ssm_scan_f32's Mamba-2 branch (one A per head): per token,
    dt_sp = softplus(dt) (threshold 20), dA = exp(dt_sp * A[h]), state = state * dA + B * (x * dt_sp),
    y = state . C; head h reads group h // (H / G) of B and C (ggml's repeat_interleave).
    A task per (row, head): it owns state[slot, h] and updates it in place, token by token."""
    n_head, d_head, d_state = x.shape[1], x.shape[2], state.shape[3]
    heads_per_group = n_head // b.shape[1]
    for job in prange(state_slot.shape[0] * n_head):
        i, h = job // n_head, job % n_head
        g = h // heads_per_group
        s = state[state_slot[i], h]  # (P, N)
        mode = flush_subnormals()  # B and C multiplied d_head times a token (see fpmode)
        for t in range(seq_off[i], seq_off[i + 1]):
            dt_sp = _softplus(dt[t, h])
            da = fexp(dt_sp * a[h])
            for p in range(d_head):
                x_dt = x[t, h, p] * dt_sp
                acc = np.float32(0.0)
                for n in range(d_state):
                    v = s[p, n] * da + b[t, g, n] * x_dt
                    s[p, n] = v
                    acc += v * c[t, g, n]
                y[t, h, p] = acc
            if snap.shape[0] > 0 and snap[t] >= 0:
                state[snap[t], h] = s
        restore_mode(mode)


@numba.njit(inline="always", **_JIT)
def _l2_row(x, eps, out, r):
    ss = 0.0
    for j in range(x.shape[1]):
        ss += np.float64(x[r, j]) * x[r, j]
    inv = np.float32(1.0 / max(math.sqrt(ss), eps))
    for j in range(x.shape[1]):
        out[r, j] = x[r, j] * inv


@numba.njit(parallel=True, **_JIT)
def l2_norm(x, eps, out):
    """ggml_l2_norm: out = x / max(||x||, eps) per row; x, out (n_rows, n), out may be x."""
    for r in prange(x.shape[0]):
        _l2_row(x, eps, out, r)


@numba.njit(**_JIT)
def l2_norm_1(x, eps, out):
    for r in range(x.shape[0]):
        _l2_row(x, eps, out, r)


@numba.njit(inline="always", **_JIT)
def _act_row(x, softplus, out, r):
    for j in range(x.shape[1]):
        v = x[r, j]
        # sigmoid on the vectorizing exp (clamped: no overflow); softplus is ggml's
        out[r, j] = _softplus(v) if softplus else np.float32(1.0) / (np.float32(1.0) + fexp(-v))


@numba.njit(parallel=True, **_JIT)
def act(x, softplus, out):
    """out = sigmoid(x), or softplus(x); x, out (n_rows, n), out may be x."""
    for r in prange(x.shape[0]):
        _act_row(x, softplus, out, r)


@numba.njit(**_JIT)
def act_1(x, softplus, out):
    for r in range(x.shape[0]):
        _act_row(x, softplus, out, r)
