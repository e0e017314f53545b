"""The cuda backend's kernels, `kernel(node, *srcs, out=None)` -> a cupy array: launches of
the .cu kernels (modules.py) for the quantized products, norms, activations, RoPE and the
fused attention; cuBLAS (cupy.matmul) for float products and bigger batches; plain cupy for
the ops that are one memory pass anyway (add, mul, scale, set_rows, the unfused attention
parts). Imported only once CuPy and a device are known to be there (backend.py).

A chunk that wants no logits (n_out == 0) sends empty tensors through the output head, and
the driver rejects a launch on an empty grid: every launch goes through `_launch`, which
skips empty grids, and cuBLAS products of no rows return their empty result unlaunched."""
from __future__ import annotations

from functools import lru_cache

import cupy as cp
import numpy as np

from hearthlm.backends.cuda.modules import kernel
from hearthlm.backends.cuda.weights import MMVQ_MAX_TOKENS, CudaWeight
from hearthlm.backends.cuda.weights import quantized as _quantized
from hearthlm.core import array_ops, kv_types
from hearthlm.core.errors import BackendError
from hearthlm.core.graph import Op, alibi_slopes, attn_bounds, lora_split

MAX_TOKENS = 8        # matmul.cu's MAX_TOKENS: the tokens of one mmvq launch
ROWS = 4              # matmul.cu's ROWS_PER_BLOCK
MAX_HEAD_DIM = 256    # attention.cu's MAX_D
SLAB_FLOATS = 1 << 26  # 256 MiB of float32: dequantize big weights for cuBLAS a slab of rows at a time
i32, i64, f32 = np.int32, np.int64, np.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=None)
def _dummy(dtype=cp.float32):
    """A stand-in for an unused pointer argument (the kernels take a flag beside it)."""
    return cp.zeros(1, dtype)


def _f(x):
    return cp.ascontiguousarray(x, dtype=cp.float32)


def _i(x):
    return cp.ascontiguousarray(x, dtype=cp.int32)


def _launch(file: str, fn: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch kernels/`file`'s `fn`, unless the grid is empty (the outputs, made by the caller,
    are then empty too)."""
    if min(grid) > 0:
        kernel(file, fn)(grid, block, args)


def _into(value, out):
    """Copy into a planned buffer, when dispatch gives one (this backend does not ask for them)."""
    if out is None:
        return value
    out[...] = value.reshape(out.shape)
    return out


# ---- products ----

def quantize_q8(x2):
    """x2 (n, K) float32 -> int8 codes (n, K), a scale per 32 and the float sums per 16."""
    n_chunks = x2.size // 32
    xq = cp.empty(x2.shape, cp.int8)
    xd, xs = cp.empty(n_chunks, cp.float32), cp.empty(2 * n_chunks, cp.float32)
    _launch("matmul.cu", "quantize_q8", (_cdiv(n_chunks, ROWS),), (32, ROWS), (x2, i64(n_chunks), xq, xd, xs))
    return xq, xd, xs


def mmvq(w: CudaWeight, x2, mode: int = 0, w2: CudaWeight | None = None, r=None):
    """(n <= MMVQ_MAX_TOKENS, K) -> (n, n_rows); mode 1 adds r, 2/3 = silu/gelu(x @ w.T) * (x @ w2.T).
    A launch per MAX_TOKENS tokens, on row slices of x's codes, r and y."""
    n, k = x2.shape
    n_rows, nc = w.shape[0], k // 32
    y = cp.empty((n, n_rows), cp.float32)
    if n == 0:
        return y
    xq, xd, xs = quantize_q8(x2)
    fn, w2raw = "mmvq_" + w.kernel, (w2 or w).raw
    for t0 in range(0, n, MAX_TOKENS):
        t1 = min(n, t0 + MAX_TOKENS)
        _launch("matmul.cu", fn, (_cdiv(n_rows, ROWS),), (32, ROWS),
                (w.raw, w2raw, i64(w.raw.shape[1]), i32(n_rows), i32(nc), xq[t0:t1], xd[t0 * nc:t1 * nc],
                 xs[2 * t0 * nc:2 * t1 * nc], i32(t1 - t0), _dummy() if r is None else r[t0:t1], y[t0:t1],
                 i32(mode)))
    return y


def dequant_rows(w: CudaWeight, ids=None, row0: int = 0, n_out: int | None = None):
    """Rows `ids` (or row0 .. row0 + n_out) of a quantized weight as float32 (n, n_cols)."""
    n_out = int(ids.shape[0]) if ids is not None else int(n_out)
    n_chunks = w.shape[1] // 32
    out = cp.empty((n_out, w.shape[1]), cp.float32)
    total = n_out * n_chunks
    _launch("matmul.cu", "dequant_" + w.kernel, (_cdiv(total, 256),), (256,),
            (w.raw, i64(w.raw.shape[1]), i32(n_chunks), _dummy(cp.int32) if ids is None else ids,
             i32(ids is not None), i64(row0), i64(n_out), out))
    return out


def _dequant_gemm(w: CudaWeight, x2):
    n_rows, n_cols = w.shape
    slab = max(1, SLAB_FLOATS // n_cols)
    if slab >= n_rows:
        return x2 @ dequant_rows(w, n_out=n_rows).T
    y = cp.empty((x2.shape[0], n_rows), cp.float32)
    for r0 in range(0, n_rows, slab):
        m = min(slab, n_rows - r0)
        y[:, r0:r0 + m] = x2 @ dequant_rows(w, row0=r0, n_out=m).T
    return y


def matmul2(w, x2):
    """x2 (n, K) float32 contiguous -> (n, n_rows)."""
    if x2.shape[0] == 0:  # cuBLAS is not asked to multiply no rows
        return cp.empty((0, w.shape[0]), cp.float32)
    if not isinstance(w, CudaWeight):
        return x2 @ _f(w).T
    if w.f is not None:
        return x2 @ w.f.T
    return mmvq(w, x2) if x2.shape[0] <= MMVQ_MAX_TOKENS else _dequant_gemm(w, x2)


def _rows(x):
    return _f(x).reshape(-1, x.shape[-1])


def mul_mat(node, w, x, out=None):
    return _into(matmul2(w, _rows(x)).reshape(node.shape), out)


def mul_mat_add(node, w, x, r, out=None):
    x2 = _rows(x)
    if _quantized(w) and x2.shape[0] <= MMVQ_MAX_TOKENS and r.shape == node.shape:
        y = mmvq(w, x2, mode=1, r=_f(r).reshape(-1, w.shape[0]))  # not (n, -1): n may be 0
        return _into(y.reshape(node.shape), out)
    return _into(matmul2(w, x2).reshape(r.shape) + r, out)


def ffn_glu(node, wg, wu, x, out=None):
    x2, act = _rows(x), node.params["act"]
    if (_quantized(wg) and _quantized(wu) and wg.ggml_type == wu.ggml_type and wg.shape == wu.shape
            and x2.shape[0] <= MMVQ_MAX_TOKENS):
        y = mmvq(wg, x2, mode=2 if act == "silu" else 3, w2=wu)
        return _into(y.reshape(node.shape), out)
    g, u = matmul2(wg, x2), matmul2(wu, x2)
    return _into(_glu(g, u, act).reshape(node.shape), out)


def get_rows(node, table, ids, out=None):
    if _quantized(table):
        return _into(dequant_rows(table, ids=_i(ids)), out)
    t = table.f if isinstance(table, CudaWeight) else table
    return _into(_f(t[_i(ids)]), out)


# ---- norms and activations ----

def _rms_norm_cupy(x, w, r, eps):
    x64 = x.astype(cp.float64)
    y = (x64 / cp.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)).astype(cp.float32)
    y = y if w is None else (y * w).astype(cp.float32)
    return y if r is None else y + r


def rms_norm(node, x, w=None, r=None, out=None):
    eps, n = node.params["eps"], x.shape[-1]
    if (w is not None and w.size != n) or (r is not None and r.shape != x.shape):
        return _into(_rms_norm_cupy(x, w, r, eps), out)  # broadcasts the kernel does not do
    x2 = _f(x)
    y = cp.empty(x.shape, cp.float32)
    threads = min(256, 32 * _cdiv(n, 32))
    _launch("norm_rope.cu", "rms_norm", (x2.size // n,), (threads,),
            (x2, _dummy() if w is None else _f(w), _dummy() if r is None else _f(r), y, i32(n), f32(eps),
             i32(w is not None), i32(r is not None)))
    return _into(y, out)


_ACTS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


def _glu(g, u, act: str, alpha: float = 0.0, limit: float = 0.0):
    g = _f(g)
    if u is not None and u.shape != g.shape:
        u = cp.broadcast_to(_f(u), g.shape) if act == "swiglu_oai" else u
        if act != "swiglu_oai":
            return _glu(g, None, act) * u  # a broadcast gate: activation here, product in cupy
    y = cp.empty(g.shape, cp.float32)
    _launch("norm_rope.cu", "glu", (_cdiv(g.size, 256),), (256,),
            (g, _dummy() if u is None else cp.ascontiguousarray(_f(u)), y, i64(g.size), i32(_ACTS[act]),
             i32(u is not None), f32(alpha), f32(limit)))
    return y


def glu(node, g, u, out=None):
    p = node.params
    return _into(_glu(g, u, p["act"], p.get("alpha", 0.0), p.get("limit", 0.0)), out)


def activation(act: str):
    return lambda node, x, out=None: _into(_glu(x, None, act), out)


# ---- rope and the KV cache ----

_freqs: dict[tuple, "cp.ndarray"] = {}


def _rope_freqs(p):
    """Scaled RoPE's per-dimension frequencies on the device, uploaded once per tuple."""
    f = p.get("freqs")
    if f is None:
        return _dummy(cp.float64)
    if f not in _freqs:
        _freqs[f] = cp.asarray(np.array(f, np.float64))
    return _freqs[f]


def _rope_launch(node, x, pos, y, slots=None):
    p = node.params
    n_tokens, n_heads, head_dim = x.shape
    total = n_tokens * n_heads * (head_dim // 2)
    _launch("norm_rope.cu", "rope", (_cdiv(total, 256),), (256,),
            (x, _i(pos), _dummy(cp.int32) if slots is None else _i(slots), y, i32(n_tokens), i32(n_heads),
             i32(head_dim), i32(p["n_rot"]), np.float64(p["base"]), np.float64(p["freq_scale"]),
             i32(bool(p["neox"])), i32(slots is not None), _rope_freqs(p), i32(p.get("freqs") is not None),
             np.float64(p.get("mscale", 1.0))))


def _rope_multi(node, x, pos):
    """Multi-position RoPE (M-RoPE, its interleaved and vision forms): plain cupy (core.array_ops)."""
    p = node.params
    return array_ops.rope_multi(x, _i(pos), cp, n_rot=p["n_rot"], base=p["base"], freq_scale=p["freq_scale"],
                                neox=p["neox"], comps=p["comps"], freqs=p.get("freqs"), mscale=p.get("mscale", 1.0))


def rope(node, x, pos, out=None):
    x = _f(x)
    if "comps" in node.params:
        return _into(_rope_multi(node, x, pos), out)
    y = cp.empty(x.shape, cp.float32)
    _rope_launch(node, x, pos, y)
    return _into(y, out)


# the KV types attention.cu reads (core.kv_types' names -> its kernels' suffix; f32 the plain ones).
# q5_0, q5_1, iq4_nl and the "+rot" Hadamard rotation are not written for cuda: refused at bind.
_KV_KERNELS = {"f32": "", "f16": "_f16", "q8_0": "_q8_0", "q4_0": "_q4_0"}


def _kv(node, src):
    """(record or None for an untagged float32 cache, kernel suffix) of the cache a node's source
    `src` reads: its type is on its CACHE node (core.kv_types), as ggml's type_k / type_v."""
    t, rot = kv_types.of(src)
    if t is None:
        return None, ""
    if rot or t.name not in _KV_KERNELS:
        raise BackendError(f"{node.label}: KV cache type {t.name}{kv_types.ROT if rot else ''} has no cuda "
                           f"kernels (these do: {', '.join(_KV_KERNELS)}); use the cpu backend for it")
    return t, _KV_KERNELS[t.name]


def _kv_store(node, cache, rows, slots, suffix):
    """rows (n, h, d) float32 into a cache's rows slots: quantized (attention.cu's kv_store_*) or
    narrowed to the cache's float type."""
    if not cache.flags.c_contiguous:
        raise BackendError(f"{node.label}: the KV cache must be a contiguous device array")
    n, h, d = rows.shape
    if cache.dtype != cp.uint8:
        cache[_i(slots)] = rows.astype(cache.dtype)
        return
    _launch("attention.cu", "kv_store" + suffix, (_cdiv(n * h * (d // 32), 128),), (128,),
            (rows, _i(slots), cache, i32(n), i32(h), i32(d)))


def set_rows(node, cache, src, slots):
    _, suffix = _kv(node, node.srcs[0])
    if slots.shape[0] == 0:
        return cache
    _kv_store(node, cache, _f(src).reshape(int(slots.shape[0]), cache.shape[1], node.shape[2]), slots, suffix)
    return cache


def rope_set_rows(node, cache, x, pos, slots):
    t, suffix = _kv(node, node.srcs[0])
    if (cache.dtype not in (cp.float32, cp.float16, cp.uint8)) or not cache.flags.c_contiguous:
        raise BackendError(f"{node.label}: the KV cache must be a contiguous float or quantized device array")
    x = _f(x).reshape(int(slots.shape[0]), cache.shape[1], node.shape[2])
    if "comps" in node.params:  # rotated (plain cupy), then stored as set_rows stores
        _kv_store(node, cache, _rope_multi(node, x, pos), slots, suffix)
    elif cache.dtype != cp.float32:  # rotated into a float buffer, then quantized or narrowed into the slots
        y = cp.empty(x.shape, cp.float32)
        _rope_launch(node, x, pos, y)
        _kv_store(node, cache, y, slots, suffix)
    else:
        _rope_launch(node, x, pos, cache, slots)
    return cache


# ---- attention ----

def attn(node, q, k_cache, v_cache, tok_seq, tok_pos, block_table, *extra, out=None):
    p = node.params
    sinks = extra[-1] if p.get("sinks") else None
    seq_len = extra[0] if len(extra) > (sinks is not None) else None
    n_tokens, n_head, d = q.shape
    n_head_kv, dv = k_cache.shape[1], node.srcs[2].shape[2]
    (_tk, suffix), (_tv, suffix_v) = _kv(node, node.srcs[1]), _kv(node, node.srcs[2])
    if suffix != suffix_v:
        raise BackendError(f"{node.label}: K and V caches of different types")
    if max(d, dv) > MAX_HEAD_DIM:
        raise BackendError(f"{node.label}: head dim {max(d, dv)} > {MAX_HEAD_DIM} in the cuda attention kernel")
    bt = _i(block_table)
    lo, hi = attn_bounds(_i(tok_pos), None if seq_len is None else _i(seq_len), p["window"], p["causal"])
    y = cp.empty((n_tokens, n_head * dv), cp.float32)
    heads = min(n_head, 8)
    # a float16 or quantized cache is read in place (attn_paged_f16 / _q8_0 / _q4_0), as bytes
    kc, vc = (_f(k_cache), _f(v_cache)) if not suffix else (k_cache.view(cp.uint8), v_cache.view(cp.uint8))
    _launch("attention.cu", "attn_paged" + suffix, (n_tokens, _cdiv(n_head, heads)),
            (32, heads), (_f(q), kc, vc, _i(tok_seq), _i(tok_pos), _i(lo), _i(hi), bt, i32(bt.shape[1]),
                          i32(n_head), i32(n_head_kv), i32(d), i32(dv), f32(p["scale"]), f32(p.get("softcap", 0.0)),
                          f32(p.get("alibi", 0.0)), i32(p["block_size"]),
                          _dummy() if sinks is None else _f(sinks), i32(sinks is not None), y))
    return _into(y, out)


def gather_kv(node, cache, block_table, out=None):
    t, suffix = _kv(node, node.srcs[0])
    bs = node.params["block_size"]
    bt = _i(block_table)
    slots = (bt[:, :, None] * bs + cp.arange(bs, dtype=cp.int32)).reshape(bt.shape[0], bt.shape[1] * bs)
    if cache.dtype != cp.uint8:
        return _into(cache[slots].astype(cp.float32, copy=False), out)
    h, d = cache.shape[1], node.shape[3]  # dequantized: the unfused path's float copy
    y = cp.empty((*slots.shape, h, d), cp.float32)
    n = int(slots.size)
    _launch("attention.cu", "kv_dequant" + suffix, (_cdiv(n * h * (d // 32), 128),), (128,),
            (cache, slots.reshape(-1), y, i64(n), i32(h), i32(d)))
    return _into(y, out)


def kq(node, q, k, tok_seq, out=None):
    n_tokens, n_head, d = q.shape
    n_head_kv = k.shape[2]
    if n_tokens == 0:
        return _into(cp.empty(node.shape, cp.float32), out)
    kt = k[_i(tok_seq)].transpose(0, 2, 3, 1)  # (n_tokens, h_kv, d, n_kv)
    s = cp.matmul(_f(q).reshape(n_tokens, n_head_kv, n_head // n_head_kv, d), kt)
    return _into(s.reshape(node.shape), out)


def attn_temp(node, pos, out=None):
    t = cp.log(cp.floor(_i(pos).astype(cp.float64) / node.params["floor"]) + 1.0) * node.params["beta"] + 1.0
    return _into(t.astype(cp.float32)[:, None, None], out)


def kq_mask(node, pos, seq_len=None, out=None):
    lo, hi = attn_bounds(_i(pos), None if seq_len is None else _i(seq_len), node.params["window"], node.params["causal"])
    p = cp.arange(node.shape[2], dtype=cp.int32)[None, :]
    ok = (p >= lo[:, None]) & (p <= hi[:, None])
    if node.params.get("alibi", 0.0) > 0:  # per head: -slope * |p - pos| where attended
        slopes = cp.asarray(alibi_slopes(node.shape[1], node.params["alibi"]))
        dist = -cp.abs(p - _i(pos)[:, None]).astype(cp.float32)
        return _into(cp.where(ok[:, None, :], slopes[None, :, None] * dist[:, None, :], f32(-np.inf)).astype(cp.float32),
                     out)
    return _into(cp.where(ok, f32(0.0), f32(-np.inf)).astype(cp.float32)[:, None, :], out)


def soft_max(node, x, sinks=None, out=None):
    if x.size == 0:
        return _into(cp.empty(x.shape, cp.float32), out)
    if sinks is None:
        e = cp.exp(x - x.max(axis=-1, keepdims=True))
        return _into(e / e.sum(axis=-1, keepdims=True), out)
    s = _f(sinks)[None, :, None]  # a logit per head in each row's denominator (gpt-oss)
    m = cp.maximum(x.max(axis=-1, keepdims=True), s)
    e = cp.exp(x - m)
    return _into(e / (e.sum(axis=-1, keepdims=True) + cp.exp(s - m)), out)


def kqv(node, probs, v, tok_seq, out=None):
    n_tokens, n_head, n_kv = probs.shape
    n_head_kv = v.shape[2]
    if n_tokens == 0:
        return _into(cp.empty(node.shape, cp.float32), out)
    vt = v[_i(tok_seq)].transpose(0, 2, 1, 3)  # (n_tokens, h_kv, n_kv, dv)
    o = cp.matmul(_f(probs).reshape(n_tokens, n_head_kv, n_head // n_head_kv, n_kv), vt)
    return _into(o.reshape(node.shape), out)


def add_n(node, *xs, out=None):
    y = cp.add(xs[0], xs[1], dtype=cp.float32)
    for x in xs[2:]:
        y += x
    return _into(y, out)


def mul(node, a, b, out=None):
    return _into(cp.multiply(a, b, dtype=cp.float32), out)


def add(node, a, b, out=None):
    return _into(cp.add(a, b, dtype=cp.float32), out)


def scale(node, x, out=None):
    return _into(cp.multiply(x, f32(node.params["s"]), dtype=cp.float32), out)


def reshape(node, x):
    return x.reshape(node.params["new_shape"])


def slice_(node, x):
    return cp.ascontiguousarray(x[..., node.params["start"]:node.params["stop"]])  # raw kernels need dense


def tanh(node, x, out=None):
    return _into(cp.tanh(x, dtype=cp.float32), out)


def clamp(node, x, out=None):
    """ggml_clamp's MAX(MIN(x, hi), lo); fmin/fmax send a NaN to hi as its comparisons do."""
    y = cp.fmin(x, f32(node.params["hi"]), dtype=cp.float32)
    return _into(cp.fmax(y, f32(node.params["lo"]), out=y), out)


def take(node, x, ids, out=None):
    return _into(cp.take_along_axis(x, ids.astype(cp.int64), -1), out)


def sum_rows(node, x, out=None):
    return _into(cp.sum(x, axis=-1, keepdims=True, dtype=cp.float32), out)


def div(node, a, b, out=None):
    return _into(cp.divide(a, b, dtype=cp.float32), out)


# ---- mixture of experts ----

def top_k(node, x, out=None):
    k = node.params["k"]
    return _into(cp.argsort(-_f(x), axis=-1)[:, :k].astype(cp.int32), out)


def mul_mat_id(node, experts, x, ids, out=None):
    """Tokens grouped per expert on the host (the ids are a few ints): each selected expert's
    weight runs once over its rows; unselected experts are not read."""
    n, k = ids.shape
    x3 = _f(x) if x.ndim == 3 else _f(x)[:, None, :]  # (n, 1 or k, cols); n may be 0
    y = cp.empty((n, k, experts[0].shape[0]), cp.float32)
    flat = cp.asnumpy(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    for e in np.unique(flat):
        rows = order[flat[order] == e]
        t, j = cp.asarray(rows // k), cp.asarray(rows % k)
        y[t, j] = matmul2(experts[int(e)], cp.ascontiguousarray(x3[t, 0] if x3.shape[1] == 1 else x3[t, j]))
    return _into(y, out)


# ---- the recurrent layers' ops ----

def sigmoid(node, x, out=None):
    return _into(cp.reciprocal(1 + cp.exp(-_f(x))), out)


def softplus(node, x, out=None):
    x = _f(x)  # ggml's: x itself above 20 (exp overflows float32 near 89)
    return _into(cp.where(x > 20, x, cp.log1p(cp.exp(cp.minimum(x, f32(20))))), out)


def l2_norm(node, x, out=None):
    """ggml_l2_norm: x * 1 / max(||x||, eps) over the last axis."""
    x = _f(x)
    x64 = x.astype(cp.float64)
    norm = cp.maximum(cp.sqrt((x64 * x64).sum(axis=-1, keepdims=True)), node.params["eps"])
    return _into(x * (1.0 / norm).astype(cp.float32), out)


SCAN_MAX_STATE = 256  # ssm.cu's SCAN_MAX_N
SCAN_ROWS, SCAN_WARPS = 4, 4  # ssm.cu's SCAN_ROWS; warps per block


def _state(node, state):
    """A recurrent-state cache (source 0): the kernels update it in place."""
    if state.dtype != cp.float32 or not state.flags.c_contiguous:
        raise BackendError(f"{node.label}: the state cache must be a contiguous float32 device array")
    return state


def _dense(node, w):
    """A float weight (the conv kernel, A) or activation as a float32 device array."""
    if isinstance(w, CudaWeight):
        if w.f is None:
            raise BackendError(f"{node.label}: a quantized {w.shape} weight where float32 is wanted")
        w = w.f
    return _f(w)


def _n_rows(x, state_slot) -> int:
    """The sequence rows to launch: none for an empty batch (its rows have no tokens to run)."""
    return int(state_slot.shape[0]) if x.shape[0] else 0


def _snap(snap: tuple, seq_off):
    """(snap, has_snap) for a state kernel: its optional per-token snapshot slots (a recurrent op's
    last source), or a pointer never read (seq_off's) and 0."""
    return (_i(snap[0]), i32(1)) if snap else (_i(seq_off), i32(0))


def ssm_conv(node, state, x, w, seq_off, state_slot, *snap, out=None):
    n, n_ch = x.shape
    y = cp.zeros((n, n_ch), cp.float32)  # padding tokens stay 0
    _launch("ssm.cu", "ssm_conv", (_n_rows(x, state_slot), _cdiv(n_ch, 128)), (128,),
            (_state(node, state), _f(x), _dense(node, w), _i(seq_off), _i(state_slot), *_snap(snap, seq_off), y,
             i32(n_ch), i32(state.shape[1])))
    return _into(y, out)


def ssm_scan(node, state, x, dt, a, b, c, seq_off, state_slot, *snap, out=None):
    n, n_head, d_head = x.shape
    n_group, d_state = b.shape[1:]
    if d_state > SCAN_MAX_STATE:
        raise BackendError(f"{node.label}: d_state {d_state} > {SCAN_MAX_STATE} in the cuda scan kernel")
    y = cp.zeros(x.shape, cp.float32)  # padding tokens stay 0
    _launch("ssm.cu", "ssm_scan", (_n_rows(x, state_slot), n_head, _cdiv(d_head, SCAN_ROWS * SCAN_WARPS)),
            (32, SCAN_WARPS),
            (_state(node, state), _f(x), _f(dt), _dense(node, a), _f(b), _f(c), _i(seq_off), _i(state_slot),
             *_snap(snap, seq_off), y, i32(n_head), i32(d_head), i32(n_group), i32(d_state)))
    return _into(y, out)


GDN_MAX_DK, GDN_MAX_DV, GDN_WARPS = 128, 128, 16  # delta_net.cu's 32 * GDN_MAX_KL, GDN_WARPS * GDN_MAX_RW


def gated_delta_net(node, state, q, k, v, g, beta, seq_off, state_slot, *snap, out=None):
    n, h_k, d_k = q.shape
    h_v, d_v = v.shape[1:]
    if d_k > GDN_MAX_DK or d_v > GDN_MAX_DV:
        raise BackendError(f"{node.label}: head dims {d_k}/{d_v} > {GDN_MAX_DK}/{GDN_MAX_DV} in the cuda delta net")
    y = cp.zeros((n, h_v, d_v), cp.float32)  # padding tokens stay 0
    _launch("delta_net.cu", "gated_delta_net", (_n_rows(q, state_slot), h_v), (32, min(GDN_WARPS, d_v)),
            (_state(node, state), _f(q), _f(k), _f(v), _f(g), _f(beta), _i(seq_off), _i(state_slot),
             *_snap(snap, seq_off), y,
             i32(h_k), i32(h_v), i32(d_k), i32(d_v), f32(node.params["scale"])))
    return _into(y, out)


def patchify(node, img, out=None):
    return _into(cp.ascontiguousarray(array_ops.patchify(_f(img), node.params["p"])), out)


def attn_full(node, q, k, v, *seg, out=None):
    return _into(array_ops.attn_full(_f(q), _f(k), _f(v), _i(seg[0]) if seg else None, cp,
                                     scale=node.params["scale"], rows=node.params.get("rows")), out)


def pool_2d(node, x, out=None):
    p = node.params
    return _into(array_ops.pool_avg_2d(_f(x), cp, nx=p["nx"], ny=p["ny"], k=p["k"]), out)


def lora(node, y, x, s, *ab, out=None):
    """Op.LORA: each adapter's products over all rows, times each row's scale (0 where the row does not
    use it); alpha / rank as llama.cpp's get_scale. Plain cuBLAS: rows are not bitwise batch-invariant here."""
    return _into(_lora_on(node.params["cols"], node.params["alphas"], y, x, s, ab).reshape(node.shape), out)


def _lora_on(cols, alphas, y, x, s, ab):
    x2, s2 = _rows(x), _f(s)
    acc = _f(y).reshape(x2.shape[0], y.shape[-1]).copy()  # not -1: an empty batch has no width to infer
    for i, (col, alpha) in enumerate(zip(cols, alphas)):
        a, b = (w.f if isinstance(w, CudaWeight) else _f(w) for w in ab[2 * i:2 * i + 2])
        sc = s2[:, col:col + 1] * (f32(alpha) / f32(a.shape[0]) if alpha else f32(1.0))
        acc += ((x2 @ a.T) @ b) * sc
    return acc


def proj_lora(node, *values, out=None):
    """MUL_MAT_LORA, MUL_MAT_ADD_LORA, FFN_GLU_LORA: the product, then its adapters (and the residual last)."""
    base, s, parts = lora_split(node, values)
    x2 = _rows(base[-1] if node.op is not Op.MUL_MAT_ADD_LORA else base[1])
    on = lambda w, part: _lora_on(part[0], part[1], matmul2(w, x2), x2, s, part[2])  # noqa: E731
    if node.op is Op.FFN_GLU_LORA:
        y = _glu(on(base[0], parts[0]), on(base[1], parts[1]), node.params["act"])
    elif node.op is Op.MUL_MAT_ADD_LORA:
        y = on(base[0], parts[0]).reshape(base[2].shape) + base[2]
    else:  # each part on its columns (q, k and v stacked)
        y = matmul2(base[0], x2)
        for (cols, alphas, ab), (o0, o1) in zip(parts, node.params.get("out_cols") or ((0, y.shape[-1]),)):
            y[:, o0:o1] = _lora_on(cols, alphas, y[:, o0:o1], x2, s, ab)
    return _into(y.reshape(node.shape), out)


KERNELS = {
    Op.LORA: lora, Op.MUL_MAT_LORA: proj_lora, Op.MUL_MAT_ADD_LORA: proj_lora, Op.FFN_GLU_LORA: proj_lora,
    Op.GET_ROWS: get_rows, Op.MUL_MAT: mul_mat, Op.MUL_MAT_ADD: mul_mat_add, Op.FFN_GLU: ffn_glu,
    Op.RMS_NORM: rms_norm, Op.RMS_NORM_MUL: rms_norm, Op.RMS_NORM_MUL_ADD: rms_norm,
    Op.MUL: mul, Op.ADD: add, Op.ADD_N: add_n, Op.SCALE: scale,
    Op.SILU: activation("silu"), Op.GELU: activation("gelu"), Op.GLU: glu,
    Op.RESHAPE: reshape, Op.SLICE: slice_,
    Op.ROPE: rope, Op.SET_ROWS: set_rows, Op.ROPE_SET_ROWS: rope_set_rows,
    Op.ATTN: attn, Op.GATHER_KV: gather_kv, Op.KQ: kq, Op.KQ_MASK: kq_mask, Op.ATTN_TEMP: attn_temp, Op.SOFT_MAX: soft_max, Op.KQV: kqv,
    Op.TANH: tanh, Op.TOP_K: top_k, Op.TAKE: take, Op.SUM_ROWS: sum_rows, Op.DIV: div, Op.MUL_MAT_ID: mul_mat_id,
    Op.SIGMOID: sigmoid, Op.SOFTPLUS: softplus, Op.CLAMP: clamp, Op.L2_NORM: l2_norm, Op.SSM_CONV: ssm_conv, Op.SSM_SCAN: ssm_scan,
    Op.GATED_DELTA_NET: gated_delta_net, Op.PATCHIFY: patchify, Op.ATTN_FULL: attn_full, Op.POOL_2D: pool_2d,
}
