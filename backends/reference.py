"""numpy reference backend: the ground truth every other backend is tested against.
Clear over fast; weights are dequantized with `gguf.quants` (cached per weight)."""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from hearthlm.core import array_ops, kv_types
from hearthlm.core.backend import Backend
from hearthlm.core.errors import UnsupportedModelError
from hearthlm.core.graph import Op, alibi_slopes, attn_bounds, lora_split
from hearthlm.core.weights import QWeight


def dequantize(w: QWeight) -> np.ndarray:
    """float32 array of w.shape."""
    try:
        if w.ggml_type == T.F32:
            return w.raw.view(np.float32).reshape(w.shape)
        if w.ggml_type == T.F16:
            return w.raw.view(np.float16).astype(np.float32).reshape(w.shape)
        return np.asarray(quants.dequantize(w.raw, T(w.ggml_type)), np.float32).reshape(w.shape)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"{w.name}: weight type {T(w.ggml_type).name} is not supported") from e


def kv_values(src, rows: np.ndarray) -> np.ndarray:
    """Rows of the KV cache node `src` reads as their values (n, ..., d) float32: its type's
    reference dequantization (core.kv_types: ggml's dequantize_row_*), rotated back where it is
    stored Hadamard-rotated; an untagged (float) cache's as they are."""
    t, rot = kv_types.of(src)
    if t is None:
        return np.asarray(rows, np.float32)
    return kv_types.decode(t, rot, rows)


def kv_encode(src, cache: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x (n, h, d) float32 as rows of the cache node `src` reads: its type's reference
    quantization (ggml's quantize_row_*_ref), Hadamard-rotated first where the type is; an
    untagged cache's element type."""
    t, rot = kv_types.of(src)
    if t is None:
        return x.astype(cache.dtype)
    return kv_types.encode(t, rot, x)


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_scale: float, neox: bool,
         freqs=None, mscale: float = 1.0, comps=None) -> np.ndarray:
    """x (n_tokens, n_heads, head_dim); rotates the first n_rot dims of each head. `freqs`
    (n_rot/2 per-dimension frequencies) replaces base and freq_scale where given (scaled RoPE);
    `mscale` scales cos and sin. `comps` (n_rot/2): pos is (n_tokens, P) and pair i turns by
    component comps[i] (multi-position RoPE)."""
    half = n_rot // 2
    inv_freq = (np.asarray(freqs, np.float64) if freqs is not None
                else freq_scale * base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot))
    p = pos[:, list(comps)] if comps is not None else pos[:, None]  # (n_tokens, half) or (n_tokens, 1)
    theta = p.astype(np.float64) * inv_freq[None, :]  # (n_tokens, half)
    cos, sin = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]
    out = x.astype(np.float32).copy()
    if neox:
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def _rope(n, x, pos):
    p = n.params
    return rope(x, pos, p["n_rot"], p["base"], p["freq_scale"], p["neox"], p.get("freqs"), p.get("mscale", 1.0),
                p.get("comps"))


def attention(q, k_cache, v_cache, tok_seq, tok_pos, block_table, seq_len=None, *, scale, block_size, window,
              softcap=0.0, alibi=0.0, causal=True, sinks=None, k_values=np.asarray, v_values=np.asarray):
    """q (n_tokens, n_head, d); caches (n_slots, n_head_kv, d) of any type: k_values / v_values
    give their rows' values (kv_values; float caches: as they are). Each
    token attends to its sequence's positions [lo, hi] (attn_bounds) through the block table;
    alibi > 0: scores less slope[h] * |p - pos| (ALiBi); sinks (n_head,): a logit per head in each
    softmax's denominator. Returns (n_tokens, n_head*d)."""
    n_tokens, n_head, _ = q.shape
    group = n_head // k_cache.shape[1]
    dv = v_values(v_cache[:0]).shape[-1]
    out = np.zeros((n_tokens, n_head, dv), np.float32)
    los, his = attn_bounds(tok_pos.astype(np.int64), None if seq_len is None else seq_len.astype(np.int64), window,
                           causal)
    for t in range(n_tokens):
        p = np.arange(los[t], his[t] + 1)
        slots = block_table[tok_seq[t], p // block_size] * block_size + p % block_size
        k = np.repeat(k_values(k_cache[slots]), group, axis=1)  # (n_kv, n_head, d)
        v = np.repeat(v_values(v_cache[slots]), group, axis=1)
        s = np.einsum("hd,khd->hk", q[t].astype(np.float64), k) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if alibi > 0:
            s = s - alibi_slopes(n_head, alibi)[:, None].astype(np.float64) * np.abs(p - tok_pos[t])
        m = s.max(axis=1, keepdims=True)
        sk = None if sinks is None else sinks.astype(np.float64)[:, None]
        m = m if sk is None else np.maximum(m, sk)
        e = np.exp(s - m)
        den = e.sum(axis=1, keepdims=True) + (0.0 if sk is None else np.exp(sk - m))
        out[t] = np.einsum("hk,khd->hd", e / den, v)
    return out.reshape(n_tokens, n_head * dv)  # -1 cannot size 0 tokens


def gather_kv(cache, block_table, block_size, values=np.asarray):
    """(n_slots, h, d) through (n_seqs, mb) -> (n_seqs, mb*block_size, h, d); `values`: as attention's."""
    slots = (block_table[:, :, None] * block_size + np.arange(block_size)).reshape(len(block_table), -1)
    return values(cache[slots])


def kq(q, k, tok_seq):
    """q (n_tokens, n_head, d), k (n_seqs, n_kv, h_kv, d) -> (n_tokens, n_head, n_kv)."""
    group = q.shape[1] // k.shape[2]
    kt = np.repeat(k[tok_seq], group, axis=2).astype(np.float64)  # (n_tokens, n_kv, n_head, d)
    return np.einsum("thd,tkhd->thk", q.astype(np.float64), kt).astype(np.float32)


def attn_temp(pos, floor, beta):
    t = np.log(np.floor(pos.astype(np.float64) / floor) + 1.0) * beta + 1.0
    return t.astype(np.float32)[:, None, None]


def kq_mask(pos, n_kv, window, seq_len=None, alibi=0.0, n_head=1, causal=None):
    p = np.arange(n_kv)[None, :]
    lo, hi = attn_bounds(pos.astype(np.int64), None if seq_len is None else seq_len.astype(np.int64), window,
                         seq_len is None if causal is None else causal)
    ok = (p <= hi[:, None]) & (p >= lo[:, None])
    if alibi > 0:  # (n_tokens, n_head, n_kv): -slope[h] * |p - pos| where attended
        dist = np.abs(p - pos.astype(np.int64)[:, None]).astype(np.float64)
        bias = -alibi_slopes(n_head, alibi).astype(np.float64)[None, :, None] * dist[:, None, :]
        return np.where(ok[:, None, :], bias, -np.inf).astype(np.float32)
    return np.where(ok, 0.0, -np.inf).astype(np.float32)[:, None, :]  # (n_tokens, 1, n_kv)


def soft_max(x, sinks=None):
    """Over the last axis; sinks (n_head,) for (n_tokens, n_head, n_kv): a logit per head with no value."""
    x = x.astype(np.float64)
    if sinks is None:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    s = sinks.astype(np.float64)[None, :, None]
    m = np.maximum(x.max(axis=-1, keepdims=True), s)
    e = np.exp(x - m)
    return (e / (e.sum(axis=-1, keepdims=True) + np.exp(s - m))).astype(np.float32)


def kqv(probs, v, tok_seq):
    group = probs.shape[1] // v.shape[2]
    vt = np.repeat(v[tok_seq], group, axis=2).astype(np.float64)  # (n_tokens, n_kv, n_head, dv)
    return np.einsum("thk,tkhd->thd", probs.astype(np.float64), vt).astype(np.float32)


def top_k(x, k):
    """Indices of the k largest per row, largest first (ties: lower index first)."""
    return np.argsort(-x.astype(np.float64), axis=-1, kind="stable")[:, :k].astype(np.int32)


def mul_mat_id(w, x, ids):
    """w (E, rows, cols), x (n, cols) or (n, k, cols), ids (n, k) -> (n, k, rows)."""
    n, k = ids.shape
    x3 = x if x.ndim == 3 else x[:, None, :]  # (n, 1 or k, cols); no reshape(-1): n may be 0
    xs = np.broadcast_to(x3, (n, k, x.shape[-1])).astype(np.float64)
    return np.einsum("tkc,tkrc->tkr", xs, w[ids].astype(np.float64)).astype(np.float32)


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def clamp(x, lo: float, hi: float):
    """ggml_clamp: MAX(MIN(x, hi), lo) in float32; fmin/fmax as C's comparisons take a NaN (to hi)."""
    return np.fmax(np.fmin(x.astype(np.float32), np.float32(hi)), np.float32(lo))


def softplus(x):
    """ggml's: log(1 + exp(x)), and x itself where x > 20 (exp would overflow float32 there)."""
    x64 = np.asarray(x, np.float64)
    return np.where(x64 > 20.0, x64, np.log1p(np.exp(np.minimum(x64, 20.0)))).astype(np.float32)


def l2_norm(x, eps):
    """ggml_l2_norm: x / max(||x||, eps) over the last axis."""
    x64 = x.astype(np.float64)
    return (x64 / np.maximum(np.sqrt((x64 * x64).sum(axis=-1, keepdims=True)), eps)).astype(np.float32)


def ssm_conv(state, x, w, seq_off, state_slot, snap=None):
    """state (S, K-1, C), x (n, C), w (C, K) -> y (n, C). Row i's tokens [seq_off[i], seq_off[i+1])
    convolve over xx = [state[slot]; x[those]] (y[t0 + j] = sum_k w[:, k] * xx[j + k]), and the
    state keeps xx's last K-1 rows. Padding tokens (in no range) give 0. `snap` (n,): where
    snap[t] >= 0, the state after token t is also written to that slot."""
    k = w.shape[1]
    y = np.zeros(x.shape, np.float32)
    for i, slot in enumerate(state_slot):
        t0, t1 = int(seq_off[i]), int(seq_off[i + 1])
        xx = np.concatenate([state[slot], x[t0:t1]]).astype(np.float64)  # (K-1 + L, C)
        y[t0:t1] = sum(w[:, j].astype(np.float64) * xx[j:j + t1 - t0] for j in range(k))
        for t in _snapped(snap, t0, t1):
            state[snap[t]] = xx[t - t0 + 1:t - t0 + k]
        state[slot] = xx[t1 - t0:]
    return y


def _snapped(snap, t0: int, t1: int) -> list[int]:
    """The tokens of [t0, t1) whose state is snapshotted."""
    return [] if snap is None else [t for t in range(t0, t1) if snap[t] >= 0]


def ssm_scan(state, x, dt, a, b, c, seq_off, state_slot, snap=None):
    """Mamba-2's selective scan (ggml's SSM_SCAN where A has one value per head), token by token.
    state (S, H, P, N), x (n, H, P), dt (n, H), a (H,) or (1, H), b and c (n, G, N) -> y (n, H, P)."""
    h = x.shape[1]
    group = np.arange(h) // (h // b.shape[1])  # ggml: g = h / (n_head / n_group), repeat_interleave
    a64 = a.reshape(-1).astype(np.float64)
    y = np.zeros(x.shape, np.float32)
    for i, slot in enumerate(state_slot):
        s = state[slot].astype(np.float64)  # (H, P, N)
        for t in range(int(seq_off[i]), int(seq_off[i + 1])):
            dt_sp = softplus(dt[t]).astype(np.float64)  # (H,)
            bt, ct = b[t][group].astype(np.float64), c[t][group].astype(np.float64)  # (H, N)
            s = s * np.exp(dt_sp * a64)[:, None, None] + (x[t] * dt_sp[:, None])[:, :, None] * bt[:, None, :]
            y[t] = np.einsum("hpn,hn->hp", s, ct)
            if snap is not None and snap[t] >= 0:
                state[snap[t]] = s
        state[slot] = s
    return y


DELTA_CHUNK = 64  # tokens per chunk of the chunked form (build_delta_net_chunking's CS)


def gated_delta_net(state, q, k, v, g, beta, seq_off, state_slot, scale, chunked=False, snap=None):
    """The gated delta rule (ggml's GATED_DELTA_NET), for each row i over tokens [seq_off[i],
    seq_off[i+1]) from state[state_slot[i]] (S, H_v, d_v, d_k), which is left holding the state
    after them. Per v-head h and token t, with key head kh = h % H_k:
        S = exp(g[t,h]) S;  S += outer((v[t,h] - S k) beta[t,h], k);  out[t,h] = S (q scale)
    q, k (n, H_k, d_k), v (n, H_v, d_v), g, beta (n, H_v) -> out (n, H_v, d_v); padding tokens 0.
    `snap` (n,): where snap[t] >= 0, the state after token t is also written to that slot (token
    by token, not chunked)."""
    h_k, h_v = q.shape[1], v.shape[1]
    # h % H_k (tiled), not GQA's h // (H_v / H_k): the unfused llama.cpp graph repeats q/k with
    # ggml_repeat_4d, and the fused ggml kernels (cpu ops.cpp, cuda) read iq1 = iv1 % neq1
    kh = np.arange(h_v) % h_k
    qq, kk = q[:, kh].astype(np.float64) * scale, k[:, kh].astype(np.float64)  # (n, H_v, d_k)
    vv, gg, bb = v.astype(np.float64), g.astype(np.float64), beta.astype(np.float64)
    run = _delta_chunked if chunked else _delta_steps
    out = np.zeros(v.shape, np.float64)
    for i, slot in enumerate(state_slot):
        t0, t1 = int(seq_off[i]), int(seq_off[i + 1])
        if t1 > t0:
            s = state[slot].astype(np.float64)  # (H_v, d_v, d_k), updated in place by run
            if _snapped(snap, t0, t1):  # token by token (the same sums as _delta_steps over the row)
                for t in range(t0, t1):
                    out[t:t + 1] = _delta_steps(s, *(z[t:t + 1] for z in (qq, kk, vv, gg, bb)))
                    if snap[t] >= 0:
                        state[snap[t]] = s
            else:
                out[t0:t1] = run(s, qq[t0:t1], kk[t0:t1], vv[t0:t1], gg[t0:t1], bb[t0:t1])
            state[slot] = s
    return out.astype(np.float32)


def _delta_steps(s, q, k, v, g, beta):
    """Token by token (ggml's fused kernel); all heads at once. q already scaled."""
    out = np.empty(v.shape)
    for t in range(len(v)):
        s *= np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hjd,hd->hj", s, k[t])) * beta[t][:, None]  # (H, d_v)
        s += delta[:, :, None] * k[t][:, None, :]
        out[t] = np.einsum("hjd,hd->hj", s, q[t])
    return out


def _delta_chunked(s, q, k, v, g, beta):
    """The same recurrence DELTA_CHUNK tokens at a time (build_delta_net_chunking's WY/UT form).
    In a chunk, with c = cumsum(g), the state after token t is
        exp(c_t) S0 + sum_{r<=t} exp(c_t - c_r) outer(u_r, k_r)
    so the deltas u solve the unit lower triangular system (I + A) u = beta (v - exp(c) S0 k),
    A[t,r] = beta_t exp(c_t - c_r) k_t.k_r for r < t; outputs and the next state follow."""
    out = np.empty(v.shape)
    for c0 in range(0, len(v), DELTA_CHUNK):
        part = slice(c0, c0 + DELTA_CHUNK)
        qc, kc, vc = (x[part].transpose(1, 0, 2) for x in (q, k, v))  # (H, C, d)
        c, bc = np.cumsum(g[part].T, axis=1), beta[part].T  # (H, C)
        n = c.shape[1]
        lower = np.tril(np.ones((n, n), bool))
        decay = np.exp(np.where(lower, c[:, :, None] - c[:, None, :], -np.inf))  # (H, t, r); 0 for r > t
        a = np.tril(bc[:, :, None] * decay * (kc @ kc.transpose(0, 2, 1)), -1)
        rhs = bc[:, :, None] * (vc - np.exp(c)[:, :, None] * (kc @ s.transpose(0, 2, 1)))  # (H, C, d_v)
        u = np.empty_like(rhs)
        for t in range(n):  # the triangular solve, by forward substitution
            u[:, t] = rhs[:, t] - np.einsum("hr,hrj->hj", a[:, t, :t], u[:, :t])
        o = np.exp(c)[:, :, None] * (qc @ s.transpose(0, 2, 1)) + (decay * (qc @ kc.transpose(0, 2, 1))) @ u
        out[part] = o.transpose(1, 0, 2)
        s *= np.exp(c[:, -1])[:, None, None]
        s += np.einsum("htj,htd->hjd", np.exp(c[:, -1:] - c)[:, :, None] * u, kc)
    return out


def _set_rows(node, cache, src, slots):
    cache[slots] = kv_encode(node.srcs[0], cache, src.reshape(len(slots), cache.shape[1], node.shape[2]))
    return cache


def _attn(n, q, k, v, seq, pos, bt, *extra):
    p = n.params
    return attention(q, k, v, seq, pos, bt, *extra[:len(extra) - p.get("sinks", False)], scale=p["scale"],
                     block_size=p["block_size"], window=p["window"], softcap=p.get("softcap", 0.0),
                     alibi=p.get("alibi", 0.0), causal=p["causal"], sinks=extra[-1] if p.get("sinks") else None,
                     k_values=lambda r: kv_values(n.srcs[1], r), v_values=lambda r: kv_values(n.srcs[2], r))


def _mm(w, x):
    return (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)


def _act(node, x):
    return silu(x) if node.params["act"] == "silu" else gelu(x)


def _swiglu_oai(node, g, u):
    """ggml_swiglu_oai: min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(u, -limit, limit) + 1)."""
    lim = node.params["limit"]
    x = np.minimum(g.astype(np.float64), lim)
    return (x / (1.0 + np.exp(-node.params["alpha"] * x)) * (np.clip(u, -lim, lim) + 1.0)).astype(np.float32)


def _lora(n, y, x, s, *ab):
    return _lora_on(n.params["cols"], n.params["alphas"], y, x, s, ab)


def _lora_on(cols, alphas, y, x, s, ab):
    """y plus, per adapter, scale * ((x a^T) b) on the rows whose scale is not 0 (float64 products)."""
    out = np.array(y, np.float32)
    for i, (col, alpha) in enumerate(zip(cols, alphas)):
        a, b = ab[2 * i], ab[2 * i + 1]
        sc = s[:, col].astype(np.float32)
        if alpha:
            sc = sc * np.float32(alpha) / np.float32(a.shape[0])
        rows = np.flatnonzero(sc)
        d = (x[rows].astype(np.float64) @ a.T.astype(np.float64)) @ b.astype(np.float64)
        out[rows] += (d * sc[rows, None]).astype(np.float32)
    return out


def _proj_lora(n, *values):
    """MUL_MAT_LORA, MUL_MAT_ADD_LORA, FFN_GLU_LORA: the unfused chain (the residual added last)."""
    base, s, parts = lora_split(n, values)
    on = lambda y, x, part: _lora_on(part[0], part[1], y, x, s, part[2])  # noqa: E731
    if n.op is Op.MUL_MAT_LORA:  # each part on its columns (q, k and v stacked)
        y = _mm(base[0], base[1])
        for part, (o0, o1) in zip(parts, n.params.get("out_cols") or ((0, y.shape[-1]),)):
            y[:, o0:o1] = on(y[:, o0:o1], base[1], part)
        return y
    if n.op is Op.MUL_MAT_ADD_LORA:
        return on(_mm(base[0], base[1]), base[1], parts[0]) + base[2]
    wg, wu, x = base
    return _act(n, on(_mm(wg, x), x, parts[0])) * on(_mm(wu, x), x, parts[1])


class ReferenceBackend(Backend):
    name = "reference"
    # what gguf.quants dequantizes; prepare_weight names a type it cannot
    weight_types = frozenset(int(t) for t in T)

    def __init__(self) -> None:
        self.kernels = {
            Op.GET_ROWS: lambda n, table, ids: np.ascontiguousarray(table[ids], np.float32),
            Op.MUL_MAT: lambda n, w, x: _mm(w, x),
            Op.RMS_NORM: lambda n, x: rms_norm(x, n.params["eps"]),
            Op.MUL: lambda n, a, b: (a * b).astype(np.float32),
            Op.ADD: lambda n, a, b: (a + b).astype(np.float32),
            Op.SCALE: lambda n, x: (x * np.float32(n.params["s"])).astype(np.float32),
            Op.SILU: lambda n, x: silu(x),
            Op.GELU: lambda n, x: gelu(x),
            Op.TANH: lambda n, x: np.tanh(x.astype(np.float64)).astype(np.float32),
            Op.RESHAPE: lambda n, x: x.reshape(n.params["new_shape"]),
            Op.SLICE: lambda n, x: x[..., n.params["start"]:n.params["stop"]],
            Op.ROPE: _rope,
            Op.SET_ROWS: _set_rows,
            Op.ATTN: _attn,
            Op.RMS_NORM_MUL: lambda n, x, w: (rms_norm(x, n.params["eps"]) * w).astype(np.float32),
            Op.GLU: lambda n, g, u: _swiglu_oai(n, g, u) if n.params["act"] == "swiglu_oai" else _act(n, g) * u,
            # unfused attention
            Op.GATHER_KV: lambda n, cache, bt: gather_kv(cache, bt, n.params["block_size"],
                                                         lambda r: kv_values(n.srcs[0], r)),
            Op.KQ: lambda n, q, k, seq: kq(q, k, seq),
            Op.KQ_MASK: lambda n, pos, *sl: kq_mask(pos, n.shape[2], n.params["window"], *(sl or (None,)),
                                                    alibi=n.params.get("alibi", 0.0), n_head=n.shape[1],
                                                    causal=n.params["causal"]),
            Op.ATTN_TEMP: lambda n, pos: attn_temp(pos, n.params["floor"], n.params["beta"]),
            Op.SOFT_MAX: lambda n, x, *sinks: soft_max(x, *sinks),
            Op.KQV: lambda n, p, v, seq: kqv(p, v, seq),
            Op.ADD_N: lambda n, *xs: sum(xs[1:], xs[0]).astype(np.float32),
            Op.TOP_K: lambda n, x: top_k(x, n.params["k"]),
            Op.TAKE: lambda n, x, ids: np.take_along_axis(x, ids.astype(np.int64), axis=-1).astype(np.float32),
            Op.SUM_ROWS: lambda n, x: x.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32),
            Op.DIV: lambda n, a, b: (a / b).astype(np.float32),
            Op.MUL_MAT_ID: lambda n, w, x, ids: mul_mat_id(w, x, ids),
            Op.LORA: _lora,
            Op.MUL_MAT_LORA: _proj_lora, Op.MUL_MAT_ADD_LORA: _proj_lora, Op.FFN_GLU_LORA: _proj_lora,
            Op.SIGMOID: lambda n, x: sigmoid(x),
            Op.SOFTPLUS: lambda n, x: softplus(x),
            Op.CLAMP: lambda n, x: clamp(x, n.params["lo"], n.params["hi"]),
            Op.L2_NORM: lambda n, x: l2_norm(x, n.params["eps"]),
            # vision towers: in float64 where they multiply
            Op.PATCHIFY: lambda n, img: np.ascontiguousarray(array_ops.patchify(img, n.params["p"]), np.float32),
            Op.ATTN_FULL: lambda n, q, k, v, *seg: array_ops.attn_full(q, k, v, seg[0] if seg else None, np,
                                                                       scale=n.params["scale"], dtype=np.float64,
                                                                       rows=n.params.get("rows")),
            Op.POOL_2D: lambda n, x: array_ops.pool_avg_2d(x.astype(np.float64), np, nx=n.params["nx"],
                                                           ny=n.params["ny"], k=n.params["k"]),
            # recurrent state: source 0 (the state cache) is updated in place
            # (an optional last source: the per-token snapshot slots)
            Op.SSM_CONV: lambda n, state, x, w, off, slot, *snap: ssm_conv(state, x, w, off, slot, *snap),
            Op.SSM_SCAN: lambda n, state, x, dt, a, b, c, off, slot, *snap: ssm_scan(state, x, dt, a, b, c, off, slot,
                                                                                      *snap),
            Op.GATED_DELTA_NET: lambda n, state, q, k, v, g, b, off, slot, *snap: gated_delta_net(
                state, q, k, v, g, b, off, slot, n.params["scale"], snap=snap[0] if snap else None),
            # fused: each rounds where its unfused chain rounds, so fused == unfused here
            Op.RMS_NORM_MUL_ADD: lambda n, x, w, r: (rms_norm(x, n.params["eps"]) * w).astype(np.float32) + r,
            Op.FFN_GLU: lambda n, wg, wu, x: _act(n, _mm(wg, x)) * _mm(wu, x),
            Op.MUL_MAT_ADD: lambda n, w, x, r: _mm(w, x) + r,
            Op.ROPE_SET_ROWS: lambda n, cache, x, pos, slots: _set_rows(n, cache, _rope(n, x, pos), slots),
        }

    def prepare_weight(self, w: QWeight) -> np.ndarray:
        return dequantize(w)
