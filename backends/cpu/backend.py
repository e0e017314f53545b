"""The numba CPU backend: packed quantized weights (qtypes/matmul) and fused-friendly
kernels (ops). Elementwise ops that numpy already runs at memory speed stay numpy.

Kernels are `kernel(node, *srcs, out=None)`: with `out` (a buffer the memory planner gave
the node, possibly a dying source's: see Op.props.inplace) they write into it and
return it; without, they allocate."""
from __future__ import annotations

import functools
import threading

import numba
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.cpu import affinity, delta_net, dot, kvquant, ops, replay, ssm, topk
from hearthlm.backends.cpu.ffn import ffn_glu
from hearthlm.backends.cpu.halfs import NATIVE_HALF
from hearthlm.backends.cpu.lora import bind_proj_lora, lora
from hearthlm.backends.cpu.matmul import expert_matvecs, get_rows, matmul, matmul_add, start_pool, tile_pool
from hearthlm.backends.cpu.qtypes import LAYOUT_VERSION, SUPPORTED_TYPES, PackedWeight, pack_weight
from hearthlm.backends.cpu.replay import call
from hearthlm.backends.cpu.softmax import softmax_cols
from hearthlm.core import array_ops, kv_types
from hearthlm.core.backend import Backend
from hearthlm.core.errors import BackendError, UnsupportedModelError
from hearthlm.core.graph import Op, alibi_slopes, attn_bounds
from hearthlm.core.log import get_logger
from hearthlm.core.weights import QWeight, RowTable

log = get_logger("hearthlm.cpu")

_NO_WEIGHT = np.zeros(0, np.float32)
_F32 = np.float32


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])


def _f32(x: np.ndarray) -> np.ndarray:
    """x as float32, a strided view left as it is: several tokens' q, k or v are column slices of
    the fused QKV product, and a copy would be a fresh array each step, which replay.py cannot
    record (one token's slice is contiguous)."""
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _buf(node, out):
    return np.empty(node.shape, np.float32) if out is None else out


def _into(node, value, out):
    """For kernels that only return fresh arrays (the matmuls): copy into the planned buffer."""
    if out is None:
        return value
    np.copyto(out, value.reshape(out.shape))
    return out


def _mul_mat(node, w, x, out=None):
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, np.ndarray):  # narrower than a quant block, kept float32 (prepare_weight)
        return _into(node, (x2 @ w.T).reshape(node.shape), out)
    if out is None or not out.flags.c_contiguous:
        return _into(node, matmul(w, x2), out)
    matmul(w, x2, out.reshape(x2.shape[0], node.shape[-1]))  # -1 cannot size an empty batch
    return out


def _rms_norm_add(node, x, w, r, out=None):
    out = _buf(node, out)
    call(ops.rms_norm_add, _rows(x), np.ascontiguousarray(w, np.float32).reshape(-1), _rows(r), node.params["eps"],
                     out.reshape(-1, x.shape[-1]))
    return out


def _glu(node, gate, up, out=None):
    out = _buf(node, out)
    p = node.params
    if p["act"] == "swiglu_oai":
        call(ops.glu_oai, _rows(gate), _rows(up), np.float32(p["alpha"]), np.float32(p["limit"]), out.reshape(-1, gate.shape[-1]))
    else:
        call(ops.glu, _rows(gate), _rows(up), p["act"] == "gelu", out.reshape(-1, gate.shape[-1]))
    return out


def _act(gelu: bool):
    def k(node, x, out=None):
        out = _buf(node, out)
        ops.glu(_rows(x), np.zeros((0, 0), np.float32), gelu, out.reshape(-1, x.shape[-1]))
        return out
    return k


_NO_FREQS, _NO_COMPS = np.zeros(0, np.float64), np.zeros(0, np.int64)
_freqs: dict[tuple, np.ndarray] = {}


def _rope_args(p) -> tuple:
    """(n_rot, base, freq_scale, neox, freqs, mscale, comps) for the kernels; scaled RoPE's
    per-dimension frequencies and multi-position RoPE's components as arrays made once per tuple."""
    f, c = p.get("freqs"), p.get("comps")
    if f is not None and f not in _freqs:
        _freqs[f] = np.array(f, np.float64)
    if c is not None and ("comps", c) not in _freqs:
        _freqs[("comps", c)] = np.array(c, np.int64)
    return (p["n_rot"], p["base"], p["freq_scale"], p["neox"], _NO_FREQS if f is None else _freqs[f],
            p.get("mscale", 1.0), _NO_COMPS if c is None else _freqs[("comps", c)])


_angle_tables = threading.local()  # per thread: one thread's kernels run one at a time


def _angles(args: tuple, n: int, n_comps: int) -> tuple[np.ndarray, np.ndarray]:
    """The calling thread's angle table (ops.rope_table) for this RoPE kind, of n rows at least:
    every layer's RoPE of a step reads the first layer's cos and sin (ops._rope_angles)."""
    tables = getattr(_angle_tables, "d", None)
    if tables is None:
        tables = _angle_tables.d = {}
    key = (*args[:4], id(args[4]), args[5], id(args[6]), n_comps)  # the arrays are _rope_args' own, kept
    t = tables.get(key)
    if t is None or t[0].shape[0] < n:
        t = tables[key] = ops.rope_table(max(n, 16), args[0], n_comps)
    return t


def _pos_rows(pos: np.ndarray) -> np.ndarray:
    """Positions as the kernels take them: a row of components per token (one, for plain RoPE)."""
    return pos.reshape(-1, 1) if pos.ndim == 1 else np.ascontiguousarray(pos)


def _bits(cache: np.ndarray) -> np.ndarray:
    """A KV cache as the kernels take it: float16 ones as their uint16 bits (numba has no float16)."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


def _kv_kind(src) -> tuple[int, int, bool]:
    """What the kernels take of the cache a node reads (core.kv_types, from its CACHE node): the
    type's kind (its ggml id; kvquant), its Hadamard size, and whether it is blocks. An untagged
    cache (op tests) is a float one: its kernels follow the array's float type."""
    t, rot = kv_types.of(src)
    return (0, 0, False) if t is None else (t.ggml_type, rot, t.quantized)


def _check_cache(node, cache, blocks: bool) -> None:
    if (cache.dtype == np.uint8) != blocks:
        raise BackendError(f"{node.label}: a {'quantized' if blocks else 'float'} KV cache type over a "
                           f"{cache.dtype} array")


def _bind_set_rows(node):
    kind, rot, blocks = _kv_kind(node.srcs[0])
    d = node.shape[2]  # the cache node's values per row, quantized or not

    def k(cache, src, slots):
        _check_cache(node, cache, blocks)
        kern = ops.set_rows if len(slots) >= ops.PAR_MIN_ROWS else ops.set_rows_1
        call(kern, _bits(cache), _f32(src).reshape(len(slots), cache.shape[1], d), slots,
             kind, rot)
        return cache
    return k


def _kv_rows(cache, slots, kind: int, rot: int, d: int, out=None) -> np.ndarray:
    """Rows `slots` of a KV cache, (n, h, d): a quantized cache's dequantized into float32 (into
    `out` where given, contiguous) and rotated back where it is stored rotated, a float cache's as they are."""
    if cache.dtype != np.uint8:
        return cache[slots]
    if out is None:
        out = np.empty((len(slots), cache.shape[1], d), np.float32)
    kvquant.dequant_rows(cache, np.ascontiguousarray(slots, np.int64), kind, rot, out)
    return out


_NO_SLOPES = np.zeros(0, np.float32)


# Bound once per compiled graph (Backend.bind): what the hot kernels read of their node.

def _bind_attn(node):
    p = node.params
    has_sinks = bool(p.get("sinks"))
    causal, window, softcap, scale, bs = p["causal"], p["window"], p.get("softcap", 0.0), p["scale"], p["block_size"]
    slopes = alibi_slopes(node.srcs[0].shape[1], p["alibi"]) if p.get("alibi", 0.0) > 0 else _NO_SLOPES
    whole = not causal and not window and not softcap and not has_sinks
    zeros: dict[int, np.ndarray] = {}  # lo of a causal attention without a window, by token count
    lows: dict[int, np.ndarray] = {}  # with one
    (kind_k, rot_k, blocks_k), (kind_v, rot_v, blocks_v) = _kv_kind(node.srcs[1]), _kv_kind(node.srcs[2])
    dk, dv = node.srcs[1].shape[2], node.srcs[2].shape[2]

    def k(q, kc, vc, seq, pos, bt, *extra, out=None):
        _check_cache(node, kc, blocks_k)
        _check_cache(node, vc, blocks_v)
        sinks = np.ascontiguousarray(extra[-1], np.float32).reshape(-1) if has_sinks else _NO_SLOPES
        seq_len = extra[0] if len(extra) > has_sinks else None
        out = _buf(node, out)
        if whole:
            return _attn_whole(q, kc, vc, seq, pos, bt, seq_len, scale, bs, slopes, out,
                               (kind_k, rot_k, dk), (kind_v, rot_v, dv))
        pos = np.ascontiguousarray(pos, np.int32)
        if causal and window <= 0 and seq_len is None:
            lo = zeros.get(len(pos))
            if lo is None:
                lo = zeros[len(pos)] = np.zeros(len(pos), np.int32)
            hi = pos
        elif causal and seq_len is None:  # a sliding window: attn_bounds' lo, into a buffer of the node's (replay)
            lo = lows.get(len(pos))
            if lo is None:
                lo = lows[len(pos)] = np.zeros(len(pos), np.int32)
            call(np.subtract, pos, np.int32(window - 1), out=lo)
            call(np.maximum, lo, np.int32(0), out=lo)
            hi = pos
        else:
            lo, hi = (np.ascontiguousarray(a, np.int32) for a in attn_bounds(pos, seq_len, window, causal))
        call(ops.attention, np.ascontiguousarray(q, np.float32), _bits(kc), _bits(vc), seq, pos, lo, hi, bt, scale, bs,
             softcap, slopes, sinks, out.reshape(q.shape[0], q.shape[1], dv), numba.get_num_threads(),
             kind_k, kind_v, rot_k, rot_v)
        return out
    return k


def _bind_rms_norm(node):
    eps = node.params["eps"]

    def k(x, w=None, out=None):
        out = _buf(node, out)
        w = _NO_WEIGHT if w is None else np.ascontiguousarray(w, np.float32).reshape(-1)
        if x.ndim == 3 and x.dtype == np.float32 and not x.flags.c_contiguous and w.shape[0] in (0, x.shape[-1]):
            kern = ops.rms_norm_heads if x.shape[0] >= ops.PAR_MIN_ROWS else ops.rms_norm_heads_1
            call(kern, x, w, eps, out.reshape(x.shape))  # several tokens' q/k norms, read where they lie
            return out
        x2 = _rows(x)
        kern = ops.rms_norm if x2.shape[0] >= ops.PAR_MIN_ROWS else ops.rms_norm_1
        call(kern, x2, w, eps, out.reshape(x2.shape))
        return out
    return k


def _bind_rope(node):
    args = _rope_args(node.params)

    def k(x, pos, out=None):
        out = _buf(node, out)
        kern = ops.rope if x.shape[0] >= ops.PAR_MIN_ROWS else ops.rope_1
        pos = _pos_rows(pos)
        call(kern, _f32(x), pos, *args, out, *_angles(args, x.shape[0], pos.shape[1]))
        return out
    return k


def _bind_rope_set_rows(node):
    args = _rope_args(node.params)
    kind, rot, blocks = _kv_kind(node.srcs[0])

    def k(cache, x, pos, slots):
        _check_cache(node, cache, blocks)
        par = x.shape[0] >= ops.PAR_MIN_ROWS
        x, pos = _f32(x), _pos_rows(pos)
        cs = _angles(args, x.shape[0], pos.shape[1])
        # RoPE-rotated into a float row, then stored (quantized, Hadamard-rotated, or narrowed to
        # float16 by bit arithmetic where the CPU has no conversion); else written in place
        if blocks or rot or (cache.dtype == np.float16 and not NATIVE_HALF):
            call(ops.rope_set_rows_q if par else ops.rope_set_rows_q_1, x, pos, slots, *args, _bits(cache), kind, rot, *cs)
        else:
            call(ops.rope_set_rows if par else ops.rope_set_rows_1, x, pos, slots, *args, _bits(cache), *cs)
        return cache
    return k


def _bind_ffn_glu(node):
    gelu = node.params["act"] == "gelu"

    def k(wg, wu, x, out=None):
        if isinstance(wg, np.ndarray):  # narrower than a quant block, kept float32 (prepare_weight)
            x2 = x.reshape(-1, wg.shape[1])
            g = x2 @ wg.T
            g = (np.float32(0.5) * g * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g ** 3)))
                 if gelu else g / (np.float32(1) + np.exp(-g)))
            o = _buf(node, out)
            np.multiply(g, x2 @ wu.T, out=o.reshape(g.shape))
            return o
        return ffn_glu(wg, wu, x, gelu, _buf(node, out))
    return k


def _bind_mul_mat_add(node):
    def k(w, x, r, out=None):
        if isinstance(w, np.ndarray):  # narrower than a quant block, kept float32 (prepare_weight)
            return np.add((x.reshape(-1, w.shape[1]) @ w.T).reshape(r.shape), r, out=out)
        return matmul_add(w, x, r, out)
    return k


def _unbound(binder):
    """A binder's kernel in the kernel(node, *srcs) form (op tests, tools)."""
    return lambda node, *srcs, **kw: binder(node)(*srcs, **kw)


_BINDERS = {Op.ATTN: _bind_attn, Op.RMS_NORM: _bind_rms_norm, Op.RMS_NORM_MUL: _bind_rms_norm,
            Op.SET_ROWS: _bind_set_rows, Op.GATHER_KV: lambda node: _bind_gather_kv(node),  # defined below
            Op.ROPE: _bind_rope, Op.ROPE_SET_ROWS: _bind_rope_set_rows, Op.FFN_GLU: _bind_ffn_glu,
            Op.MUL_MAT_ADD: _bind_mul_mat_add, Op.MUL_MAT_LORA: bind_proj_lora, Op.MUL_MAT_ADD_LORA: bind_proj_lora,
            Op.FFN_GLU_LORA: bind_proj_lora,
            Op.MUL_MAT: lambda node: functools.partial(_mul_mat, node)}


def _attn_whole(q, k, v, seq, pos, bt, seq_len, scale, bs, slopes, out, kk_args, vv_args):
    """An encoder's attention: each run of tokens of one sequence (and length) against all of that
    sequence's keys, as batched matrix products per KV head (BLAS), where the flash kernel's job per
    token and head would re-read the keys for every token (~15x slower per FLOP at 80 tokens).
    slopes not empty: ALiBi, each score less slopes[h] * |p - pos|. kk_args, vv_args: each cache's
    (kind, Hadamard size, head dim), read as values (_kv_rows)."""
    n, n_head, d = q.shape
    h_kv, dv = k.shape[1], vv_args[2]
    g = n_head // h_kv
    o = out.reshape(n, n_head, dv)
    cuts = np.flatnonzero((np.diff(seq) != 0) | (np.diff(seq_len) != 0)) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, n]):
        if lo == hi:
            continue
        m = int(seq_len[lo])
        p = np.arange(m)
        slots = bt[seq[lo], p // bs] * bs + p % bs
        # contiguous: numpy's stacked matmul goes to BLAS only for dense operands
        kk = np.ascontiguousarray(_kv_rows(k, slots, *kk_args).transpose(1, 2, 0), np.float32)  # (h_kv, d, m)
        vv = np.ascontiguousarray(_kv_rows(v, slots, *vv_args).transpose(1, 0, 2), np.float32)  # (h_kv, m, dv)
        qq = np.ascontiguousarray(q[lo:hi].reshape(hi - lo, h_kv, g, d).transpose(1, 0, 2, 3)).reshape(
            h_kv, (hi - lo) * g, d)
        s = np.matmul(qq, kk) * np.float32(scale)  # (h_kv, tokens * g, m)
        if len(slopes):  # (h_kv, tokens, g, m) as the rows of s: slope * -|p - pos|, ggml's mask times slope
            dist = -np.abs(p[None, :] - pos[lo:hi, None]).astype(np.float32)
            s += (slopes.reshape(h_kv, 1, g, 1) * dist[None, :, None, :]).reshape(s.shape)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        r = np.matmul(s, vv)  # (h_kv, tokens * g, dv)
        o[lo:hi] = r.reshape(h_kv, hi - lo, g, dv).transpose(1, 0, 2, 3).reshape(hi - lo, n_head, dv)
    return out


def _bind_gather_kv(node):
    bs = node.params["block_size"]
    kind, rot, blocks = _kv_kind(node.srcs[0])
    d = node.shape[3]

    def k(cache, bt, out=None):
        _check_cache(node, cache, blocks)
        slots = (bt[:, :, None] * bs + np.arange(bs, dtype=np.int32)).reshape(-1)
        out = _buf(node, out)
        rows = out.reshape(len(slots), *node.shape[2:])
        if blocks and rows.flags.c_contiguous:
            _kv_rows(cache, slots, kind, rot, d, rows)  # dequantized in place
        else:
            rows[...] = _kv_rows(cache, slots, kind, rot, d)  # float16 caches widen here
        return out
    return k


def _attn_temp(node, pos, out=None):
    """As llama.cpp computes it on the host (float32 of the float expression), per token."""
    out = _buf(node, out)
    t = np.log(np.floor(pos.astype(np.float64) / node.params["floor"]) + 1.0) * node.params["beta"] + 1.0
    np.copyto(out, t.astype(np.float32)[:, None, None])
    return out


def _kq_mask(node, pos, seq_len=None, out=None):
    lo, hi = attn_bounds(pos, seq_len, node.params["window"], node.params["causal"])
    p = np.arange(node.shape[2])[None, :]
    ok = (p >= lo[:, None]) & (p <= hi[:, None])
    out = _buf(node, out)
    if node.params.get("alibi", 0.0) > 0:  # per head: -slope * |p - pos| where attended
        dist = -np.abs(p - pos[:, None]).astype(np.float32)
        bias = alibi_slopes(node.shape[1], node.params["alibi"])[None, :, None] * dist[:, None, :]
        np.copyto(out, np.where(ok[:, None, :], bias, _F32(-np.inf)))
        return out
    np.copyto(out, np.where(ok, _F32(0.0), _F32(-np.inf))[:, None, :])
    return out


def _soft_max(node, x, sinks=None, out=None):
    # numpy, not numba: fastmath would assume the masked -inf away
    out = _buf(node, out)
    if sinks is None:
        np.subtract(x, x.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
        return out
    s = np.asarray(sinks, np.float32).reshape(1, -1, 1)  # a logit per head in each row's denominator (gpt-oss)
    m = np.maximum(x.max(axis=-1, keepdims=True), s)
    np.subtract(x, m, out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True) + np.exp(s - m)
    return out


def _kq(node, q, k, seq, out=None):
    out = _buf(node, out)
    ops.kq(np.ascontiguousarray(q, np.float32), k, seq, out)
    return out


def _kqv(node, probs, v, seq, out=None):
    out = _buf(node, out)
    ops.kqv(np.ascontiguousarray(probs, np.float32), v, seq, out)
    return out


def _add_n(node, *xs, out=None):
    out = _buf(node, out)
    # the planner may hand over any source's buffer (Op.props.inplace): add into it first, before
    # the other terms overwrite it
    i = next((i for i, x in enumerate(xs) if np.may_share_memory(x, out)), 0)
    xs = (xs[i], *xs[:i], *xs[i + 1:])
    np.add(xs[0], xs[1], out=out)
    for x in xs[2:]:
        np.add(out, x, out=out)
    return out


class FileRows:
    """A RowTable left in the model file: each lookup copies the rows it asks for out of the mmap
    and packs just those (RSS and first load untouched by the table; llama.cpp's TENSOR_READ_LAZY)."""

    def __init__(self, w: RowTable) -> None:
        self.w, self.shape = w, tuple(w.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)  # (n,)
        n_rows, n_cols = self.shape
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"row id out of range 0..{n_rows - 1}")
        if not ids.size:
            return np.zeros((0, n_cols), np.float32)
        raw = np.asarray(self.w.raw).reshape(n_rows, -1)[ids]  # (n, row_bytes): only these rows' pages read
        return get_rows(pack_weight(self.w.ggml_type, raw, (ids.size, n_cols)), np.arange(ids.size, dtype=np.int32))


def _get_rows(node, table, ids, out=None):
    if isinstance(table, FileRows):
        return _into(node, table.rows(ids), out)
    if isinstance(table, PackedWeight):
        got = get_rows(table, ids, out)
        return got if got is out else _into(node, got, out)
    if out is None:
        return np.ascontiguousarray(table[ids], np.float32)
    return call(np.take, table, ids, axis=0, out=out)


def _unary(softplus: bool):
    """SIGMOID, or SOFTPLUS (ggml's, threshold 20): one compiled pass, out may be x."""
    def k(node, x, out=None):
        out = _buf(node, out)
        x2 = _rows(x)
        (ssm.act if x2.shape[0] >= ops.PAR_MIN_ROWS else ssm.act_1)(x2, softplus, out.reshape(x2.shape))
        return out
    return k


def _clamp(node, x, out=None):
    """ggml_clamp's MAX(MIN(x, hi), lo); fmin/fmax send a NaN to hi as its comparisons do."""
    out = np.fmin(x, np.float32(node.params["hi"]), out=out, dtype=np.float32)
    return np.fmax(out, np.float32(node.params["lo"]), out=out)


def _l2_norm(node, x, out=None):
    out = _buf(node, out)
    x2 = _rows(x)
    (ssm.l2_norm if x2.shape[0] >= ops.PAR_MIN_ROWS else ssm.l2_norm_1)(x2, node.params["eps"], out.reshape(x2.shape))
    return out


# ---- recurrent state: the kernels update the state cache (source 0) in place and return y ----

def _state(node, state):
    if state.dtype != np.float32 or not state.flags.c_contiguous:
        raise BackendError(f"{node.label}: the state cache must be a contiguous float32 array, not {state.dtype}")
    return state


def _ranges(node, seq_off, slots, out, snap=()):
    """(seq_off, state_slot, snap) as the kernels take them (snap empty where the op has none),
    and y with its padding tokens (in no range: before seq_off[0] or from seq_off[-1] on) zeroed;
    the kernels write the rest."""
    seq_off, slots = np.ascontiguousarray(seq_off, np.int32), np.ascontiguousarray(slots, np.int32)
    snap = np.ascontiguousarray(snap[0], np.int32) if snap else _NO_SNAP
    y = _buf(node, out)
    lo, hi = (int(seq_off[0]), int(seq_off[-1])) if len(slots) else (0, 0)
    y[:lo] = 0
    y[hi:] = 0
    return seq_off, slots, snap, y


_NO_SNAP = np.zeros(0, np.int32)


def _ssm_conv(node, state, x, w, seq_off, slots, *snap, out=None):
    seq_off, slots, snap, y = _ranges(node, seq_off, slots, out, snap)
    # w (C, K) is float32 here (prepare_weight keeps narrow matrices so); as (K, C) the
    # kernel's loop over channels reads it contiguously (a copy of C*K floats a call)
    w_t = np.ascontiguousarray(np.asarray(w, np.float32).T)
    ssm.ssm_conv(_state(node, state), np.ascontiguousarray(x, np.float32), w_t, seq_off, slots, snap, y)
    return y


def _ssm_scan(node, state, x, dt, a, b, c, seq_off, slots, *snap, out=None):
    seq_off, slots, snap, y = _ranges(node, seq_off, slots, out, snap)
    if isinstance(a, PackedWeight):  # A stored as (1, H): packed as a float matrix
        if a.layout != "f32":
            raise BackendError(f"{node.label}: A must be a float32 weight")
        a = a.w
    f = lambda v: np.ascontiguousarray(v, np.float32)  # noqa: E731
    ssm.ssm_scan(_state(node, state), f(x), f(dt), f(a).reshape(-1), f(b), f(c), seq_off, slots, snap, y)
    return y


def _gated_delta_net(node, state, q, k, v, g, beta, seq_off, slots, *snap, out=None):
    seq_off, slots, snap, y = _ranges(node, seq_off, slots, out, snap)
    f = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    par = len(slots) * v.shape[1] >= ops.PAR_MIN_ROWS  # tasks: (sequence, v-head) pairs
    (delta_net.gated_delta_net if par else delta_net.gated_delta_net_1)(
        _state(node, state), f(q), f(k), f(v), f(g), f(beta), seq_off, slots, snap, node.params["scale"], y)
    return y


class Experts(tuple):
    """A stacked expert weight (E, rows, cols): one PackedWeight per expert. `lists`: their
    arrays as numba typed lists, for the one-token compiled path (made on first use)."""
    lists = None

    def typed_lists(self):
        """(tag, qs, d, m, sup, ms, c, sub) for matmul.expert_matvecs, or None where the experts are
        not all of one quantized kind (F32 ones, or absent ones in tests)."""
        if self.lists is None:
            kinds = {getattr(w, "kind", -1) for w in self}
            self.lists = False
            if len(kinds) == 1 and kinds.pop() >= 0:
                try:
                    self.lists = (dot.TAGS[self[0].kind], *(_typed([getattr(w, a) for w in self])
                                                            for a in ("qs", "d", "m", "sup")),
                                  self[0].ms, self[0].c32, self[0].sub)
                except Exception:  # arrays of unlike numba types (say, some read-only): the grouped path
                    self.lists = False
        return self.lists or None


def _typed(arrays):
    from numba.typed import List
    out = List()
    for a in arrays:
        out.append(a)
    return out


def _mul_mat_id(node, experts, x, ids, out=None):
    """Tokens grouped per expert: each selected expert's weight is read once, for all the
    (token, slot) rows routed to it; experts nobody selected are not read at all. One token
    (decode) goes through its experts in one compiled call."""
    n, k = ids.shape
    out = _buf(node, out)
    if n == 0:  # an empty batch
        return out
    x3 = x if x.ndim == 3 else x[:, None, :]  # (n, 1 or k, cols)
    lists = experts.typed_lists() if n == 1 else None
    if lists is not None and out.flags.c_contiguous:
        start_pool()
        expert_matvecs(*lists, np.ascontiguousarray(x3, dtype=np.float32), np.ascontiguousarray(ids, np.int64),
                       out.reshape(1, k, -1))
        return out
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(order)]):
        rows = order[a:b]
        t, j = rows // k, rows % k
        xin = x3[t, 0] if x3.shape[1] == 1 else x3[t, j]
        out[t, j] = matmul(experts[sorted_ids[a]], xin)
    return out


def _top_k(node, x, out=None):
    k = node.params["k"]
    top = np.argpartition(-x, k - 1, axis=-1)[:, :k] if k < x.shape[-1] else np.broadcast_to(
        np.arange(x.shape[-1]), x.shape)
    order = np.argsort(-np.take_along_axis(x, top, axis=-1), axis=-1, kind="stable")
    res = np.take_along_axis(top, order, axis=-1).astype(np.int32)
    if out is None:
        return res
    out[...] = res
    return out


def _binary(ufunc):
    return lambda n, a, b, out=None: call(ufunc, a, b, out=out, dtype=np.float32)


ARGMAX_SPLIT = 1 << 20  # values from which argmax_rows splits the rows over two threads


class CPUBackend(Backend):
    name = "cpu"
    weight_types = SUPPORTED_TYPES
    plans_memory = True  # kernels accept out=: runtime.memory places intermediates in one arena
    # what op tests feed an untagged cache; the runtime stores core.kv_types' ("f16": float16
    # everywhere, narrowed by bit arithmetic where the CPU has no conversion)
    kv_dtype = np.dtype(np.float16 if NATIVE_HALF else np.float32)
    weight_layout = f"cpu-qtypes-{LAYOUT_VERSION}"

    def __init__(self) -> None:
        self._spreaders: dict[int, affinity.Spreader] = {}  # by engine thread
        self.kernels = {
            Op.GET_ROWS: _get_rows,
            Op.MUL_MAT: _mul_mat,
            Op.MUL_MAT_ADD: _unbound(_bind_mul_mat_add),
            Op.RMS_NORM: _unbound(_bind_rms_norm),
            Op.RMS_NORM_MUL: _unbound(_bind_rms_norm),
            Op.RMS_NORM_MUL_ADD: _rms_norm_add,
            Op.MUL: _binary(np.multiply),
            Op.ADD: _binary(np.add),
            Op.ADD_N: _add_n,
            Op.SCALE: lambda n, x, out=None: call(np.multiply, x, np.float32(n.params["s"]), out=out, dtype=np.float32),
            Op.SILU: _act(False),
            Op.GELU: _act(True),
            Op.TANH: lambda n, x, out=None: np.tanh(x, out=out, dtype=np.float32),
            Op.GLU: _glu,
            Op.FFN_GLU: _unbound(_bind_ffn_glu),
            Op.RESHAPE: lambda n, x: x.reshape(n.params["new_shape"]),
            Op.SLICE: lambda n, x: x[..., n.params["start"]:n.params["stop"]],
            Op.ROPE: _unbound(_bind_rope),
            Op.SET_ROWS: _unbound(_bind_set_rows),
            Op.ROPE_SET_ROWS: _unbound(_bind_rope_set_rows),
            Op.GATHER_KV: _unbound(_bind_gather_kv),
            Op.KQ: _kq,
            Op.KQ_MASK: _kq_mask,
            Op.ATTN_TEMP: _attn_temp,
            Op.SOFT_MAX: _soft_max,
            Op.KQV: _kqv,
            Op.ATTN: _unbound(_bind_attn),
            Op.TOP_K: _top_k,
            Op.TAKE: lambda n, x, ids, out=None: _into(n, np.take_along_axis(x, ids.astype(np.intp), axis=-1), out),
            Op.SUM_ROWS: lambda n, x, out=None: np.sum(x, axis=-1, keepdims=True, out=out, dtype=np.float32),
            Op.DIV: _binary(np.divide),
            Op.MUL_MAT_ID: _mul_mat_id,
            Op.LORA: lora,
            Op.MUL_MAT_LORA: _unbound(bind_proj_lora),
            Op.MUL_MAT_ADD_LORA: _unbound(bind_proj_lora),
            Op.FFN_GLU_LORA: _unbound(bind_proj_lora),
            Op.SIGMOID: _unary(False),
            Op.SOFTPLUS: _unary(True),
            Op.CLAMP: _clamp,
            Op.L2_NORM: _l2_norm,
            Op.SSM_CONV: _ssm_conv,
            Op.PATCHIFY: lambda n, img, out=None: _into(n, array_ops.patchify(img, n.params["p"]), out),
            Op.ATTN_FULL: lambda n, q, k, v, *seg, out=None: _into(n, array_ops.attn_full(
                q, k, v, seg[0] if seg else None, np, scale=n.params["scale"], rows=n.params.get("rows"),
                softmax=softmax_cols), out),
            Op.POOL_2D: lambda n, x, out=None: _into(n, array_ops.pool_avg_2d(
                x, np, nx=n.params["nx"], ny=n.params["ny"], k=n.params["k"]), out),
            Op.SSM_SCAN: _ssm_scan,
            Op.GATED_DELTA_NET: _gated_delta_net,
        }

    def argmax_rows(self, value):
        """numpy's argmax (it lets go of the GIL), the rows in two halves on two threads where
        they are many: 64 rows of a 152K vocabulary took 1.55 ms on one, 1.0 on two."""
        x = np.asarray(value)
        n = x.shape[0]
        if n < 2 or x.size < ARGMAX_SPLIT or numba.get_num_threads() < 2:
            return x.argmax(axis=1)
        h = n // 2
        rest = tile_pool(1).submit(x[h:].argmax, axis=1)
        return np.concatenate([x[:h].argmax(axis=1), rest.result()])

    def top_k_rows(self, value, ks):
        """The numba kernel (backends/cpu/topk.py): its rows spread over the threads, ~40 us a
        row of a 152K vocabulary where numpy's partition took ~180."""
        x = np.ascontiguousarray(value, np.float32)
        ks = np.asarray(ks, np.int64)
        kmax = max(int(ks.max(initial=0)), 1)
        ids, vals = np.zeros((x.shape[0], kmax), np.int64), np.zeros((x.shape[0], kmax), np.float32)
        ok = np.ones(x.shape[0], bool)
        start_pool()
        topk.top_k_rows(x, ks, ids, vals, ok)
        return ids, vals, ok

    def bind(self, node):
        binder = _BINDERS.get(node.op)
        return binder(node) if binder else super().bind(node)

    def graph_runner(self, cg):
        """Decode-sized steps replay their recorded kernel calls: backends/cpu/replay.py."""
        return replay.runner(cg)

    def bind_thread(self) -> None:
        # numba's thread pool, started from the engine's thread (the one whose kernels it serves
        # at full speed: matmul.start_pool) as the engine starts, not inside a request's first
        # kernel: 0.13-0.18 s of the first 512-token prefill after open on a 2-core Xeon
        start_pool()

    def thread_counts(self) -> tuple[int, ...]:
        # all of numba's threads, or one: a parallel kernel waits at its end for every worker,
        # so one worker descheduled by another process stalls each kernel of a step (measured:
        # one competing process cut decode to 0.13 of its quiet rate at 2 threads)
        import numba
        n = numba.config.NUMBA_NUM_THREADS
        return (n, 1) if n > 1 else ()

    def use_threads(self, n: int) -> None:
        import numba
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)  # per calling thread: the engine's
        sp = self._spreaders.get(threading.get_native_id())
        if sp is not None and n > 1:  # once workers have been found stacked, kept apart in each step
            sp.spread(every=True)

    def after_step(self, n: int | None, slow: bool) -> bool:
        if not n or n < 2:
            return False
        sp = self._spreaders.get(threading.get_native_id())
        if sp is None:
            if not slow or not affinity.supported():
                return False
            sp = self._spreaders.setdefault(threading.get_native_id(), affinity.Spreader())
        sp.release()
        return slow and sp.spread()

    def loaded(self) -> None:
        if not kernels_cached():
            log.warning("compiling the CPU kernels for this machine: the first generation waits for it, once "
                        "(about 20 s on 2 cores); `hearthlm prepare MODEL` does it ahead of time")

    def prepare_weight(self, w: QWeight):
        if int(w.ggml_type) not in SUPPORTED_TYPES:  # named with the tensor (pack_weight knows only the type)
            name = T(w.ggml_type).name if int(w.ggml_type) in T._value2member_map_ else f"ggml type {w.ggml_type}"
            raise UnsupportedModelError(f"{w.name}: the CPU backend cannot run weights of type {name}")
        if isinstance(w, RowTable) and len(w.shape) == 2 and w.shape[1] >= 32:
            return FileRows(w)
        if len(w.shape) == 1 or (len(w.shape) == 2 and w.shape[1] < 32):
            # norms and biases, and matrices narrower than a quant block (conv kernels): float32
            from hearthlm.backends.reference import dequantize
            return np.ascontiguousarray(dequantize(w))
        if len(w.shape) == 3:  # stacked experts: each packed on its own (only selected ones are read)
            n_exp, rows = w.shape[0], w.shape[1]
            return Experts(pack_weight(w.ggml_type, w.raw[e * rows:(e + 1) * rows], w.shape[1:])
                           for e in range(n_exp))
        return pack_weight(w.ggml_type, w.raw, w.shape)  # drops the file's pages of what it copies

    def export_weight(self, p):
        if isinstance(p, FileRows):
            return None  # the file itself holds it
        if isinstance(p, Experts):  # each expert as a packed weight of its own, arrays "<expert>.<name>"
            parts = [self.export_weight(e) for e in p]
            if any(part is None for part in parts):
                return None  # views of the model file (F32/F16 experts): nothing to save
            return (dict(kind="experts", parts=[m for m, _ in parts]),
                    {f"{i}.{k}": a for i, (_, arrays) in enumerate(parts) for k, a in arrays.items()})
        if isinstance(p, np.ndarray):
            return {"kind": "vector"}, {"v": p}
        if p.layout in ("f32", "half") and not (p.w if p.layout == "f32" else p.qs).flags.writeable:
            return None  # a view of the (read-only) model file: nothing to save
        meta = dict(kind="packed", ggml_type=p.ggml_type, shape=list(p.shape), layout=p.layout, sub=p.sub,
                    ms=p.ms, c=p.c)
        return meta, {k: a for k, a in (("w", p.w), ("qs", p.qs), ("d", p.d), ("m", p.m), ("sup", p.sup))
                      if a is not None}

    def import_weight(self, meta, arrays):
        if meta["kind"] == "vector":
            return arrays["v"]
        if meta["kind"] == "experts":
            return Experts(self.import_weight(m, {k.split(".", 1)[1]: a for k, a in arrays.items()
                                                  if k.split(".", 1)[0] == str(i)})
                           for i, m in enumerate(meta["parts"]))
        return PackedWeight(meta["ggml_type"], tuple(meta["shape"]), meta["layout"], meta["sub"], w=arrays.get("w"),
                            qs=arrays.get("qs"), d=arrays.get("d"), m=arrays.get("m"), sup=arrays.get("sup"),
                            ms=meta["ms"], c=meta["c"])


def kernels_cached() -> bool:
    """Whether numba's cache holds compiled matmul kernels for this machine (else the first
    generation compiles them). Reads numba's cache index path, an internal: if that moves,
    this says True rather than warn wrongly."""
    import os

    from hearthlm.backends.cpu import dot
    try:
        return os.path.exists(dot.dot_any._cache._cache_file._index_path)
    except AttributeError:
        return True
