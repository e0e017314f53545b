"""The lazy compute graph: ops add named nodes to a DAG; nothing computes until a backend
runs the graph (see `runtime.dispatch`). Shapes are numpy order, activations float32,
e.g. `# (n_tokens, n_embd)`. Nodes are created in topological order by construction."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class OpProps:
    """What runtime needs to know of an op besides its kernels, in one place: the memory
    planner, fusion, placement and dispatch read these, never tables of their own."""
    bound: bool = False         # a leaf whose value is bound, not computed (feed, weights, KV cache)
    per_backend: bool = False   # a bound leaf each backend binds its own of (uploads, packs): never copied
    writes_cache: bool = False  # writes its first source (a cache) in place and returns it: kept though
                                # unread, runs where the cache lives, never planned
    view: bool = False          # shares its first source's buffer
    inplace: tuple[int, ...] = ()  # sources whose buffer the output may take (each element read before written)
    commutative: bool = False   # binary op whose sources fusion patterns may match in either order
    moves: bool = False         # dispatch runs it (a copy between backends), not a backend kernel
    updates_state: bool = False  # updates its first source (a recurrent-state cache) in place and
                                 # returns a new value: runs where the cache lives, the cache never planned


_LEAF = OpProps(bound=True, per_backend=True)


def attn_bounds(pos, seq_len, window: int, causal: bool):
    """Each token's attend range [lo, hi] (inclusive) in its sequence, numpy or cupy arrays alike.
    Causal: [pos - window + 1 (or 0), pos], or up to seq_len - 1 where given. Non-causal (an encoder's whole sequence, seq_len
    tokens): everything, or with a window llama.cpp's symmetric one, |p - pos| <= window // 2."""
    if causal:  # seq_len with causal: each token's horizon (an image's tokens see all of it, llama.cpp's
        hi = pos if seq_len is None else seq_len - 1  # non-causal image batch over a causal text)
        return (pos - window + 1).clip(0) if window > 0 else pos * 0, hi
    hi = seq_len - 1
    if window <= 0:
        return pos * 0, hi
    half = window // 2
    return (pos - half).clip(0), hi + (pos + half - hi).clip(None, 0)


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi's per-head slopes as ggml's soft_max_ext / flash_attn_ext derive them from max_bias
    (float32 powf): m0^(h+1) for the first 2^floor(log2 n_head) heads, m1^(2(h-n)+1) after."""
    n = 1 << int(math.floor(math.log2(n_head)))
    m0 = np.float32(2.0) ** np.float32(-max_bias / n)
    m1 = np.float32(2.0) ** np.float32(-(max_bias / 2.0) / n)
    h = np.arange(n_head)
    return np.where(h < n, m0 ** (h + 1).astype(np.float32),
                    m1 ** (2 * (h - n) + 1).astype(np.float32)).astype(np.float32)


class Op(enum.Enum):
    def __new__(cls, value: str, props: OpProps = OpProps()):
        obj = object.__new__(cls)
        obj._value_ = value
        obj.props = props
        return obj

    INPUT = "input", _LEAF    # per-step data (token ids, positions, KV slots, ...)
    WEIGHT = "weight", _LEAF  # model parameter; backends hold it packed (see prepare_weight)
    CACHE = "cache", OpProps(bound=True)  # persistent buffer (a layer's K or V cache), mutated in place
    GET_ROWS = "get_rows"    # (table, ids) -> table[ids]; table is a weight or an activation
    MUL_MAT = "mul_mat"      # (w, x) -> x @ w.T
    RMS_NORM = "rms_norm", OpProps(inplace=(0,))  # (x,) over the last axis; params: eps
    MUL = "mul", OpProps(inplace=(0, 1), commutative=True)  # (a, b) broadcast
    ADD = "add", OpProps(inplace=(0, 1), commutative=True)  # (a, b) broadcast
    SCALE = "scale", OpProps(inplace=(0,))  # (x,) * params["s"]
    SILU = "silu", OpProps(inplace=(0,))
    GELU = "gelu", OpProps(inplace=(0,))    # tanh approximation, as ggml_gelu
    TANH = "tanh", OpProps(inplace=(0,))    # (x,) elementwise (Gemma 2's logit soft-capping)
    SIGMOID = "sigmoid", OpProps(inplace=(0,))
    SOFTPLUS = "softplus", OpProps(inplace=(0,))  # log(1 + exp(x)); x where x > 20 (as ggml)
    # (x,) -> max(min(x, hi), lo), ggml_clamp's order (NaN gives hi); params: lo, hi (Gemma 4's clippable linears)
    CLAMP = "clamp", OpProps(inplace=(0,))
    L2_NORM = "l2_norm", OpProps(inplace=(0,))    # (x,) / max(||x||, eps) over the last axis; params: eps
    # (x (n_tokens, n_heads, head_dim), pos (n_tokens,)); params: n_rot, base, freq_scale, neox[, freqs, mscale]
    ROPE = "rope", OpProps(inplace=(0,))
    # (cache, src, slots): cache[slots] = src; returns the cache (orders later reads)
    SET_ROWS = "set_rows", OpProps(writes_cache=True)
    RESHAPE = "reshape", OpProps(view=True)  # (x,) params: shape
    SLICE = "slice", OpProps(view=True)      # (x,) -> x[..., start:stop], a view; params: start, stop
    # attention, unfused: what the builders emit (runtime.fusion turns it into ATTN)
    GATHER_KV = "gather_kv"  # (cache (n_slots, h, d), block_table (n_seqs, mb)) -> (n_seqs, mb*block_size, h, d)
    KQ = "kq"                # (q (n_tokens, n_head, d), k (n_seqs, n_kv, h_kv, d), tok_seq) -> (n_tokens, n_head, n_kv); GQA
    # (pos (n_tokens,)) -> (n_tokens, 1, 1): log(floor(pos / floor) + 1) * beta + 1, Llama 4's attention
    # temperature on Q (Ministral 3); params: floor, beta
    ATTN_TEMP = "attn_temp"
    # (pos (n_tokens,)[, seq_len (n_tokens,)]) -> (n_tokens, 1, n_kv): 0 on the token's attend range
    # (attn_bounds), else -inf; params: window, causal (False: an encoder's, seq_len given), alibi
    # (ggml's max_bias; > 0: (n_tokens, n_head, n_kv), -slope[h] * |p - pos| on the range)
    KQ_MASK = "kq_mask"
    SOFT_MAX = "soft_max", OpProps(inplace=(0,))  # (x,) over the last axis
    KQV = "kqv"              # (probs (n_tokens, n_head, n_kv), v (n_seqs, n_kv, h_kv, dv), tok_seq) -> (n_tokens, n_head, dv)
    ADD_N = "add_n", OpProps(inplace=(0, 1, 2, 3))  # (a, b, c, ...) -> their sum, one pass
    # mixture of experts (llama.cpp's build_moe_ffn)
    TOP_K = "top_k"          # (x (n, E),) -> (n, k) int32: indices of the k largest, largest first; params: k
    TAKE = "take"            # (x (n, E), ids (n, k)) -> (n, k): x[i, ids[i, j]]
    SUM_ROWS = "sum_rows"    # (x (..., n),) -> (..., 1)
    DIV = "div"              # (a, b) broadcast
    # (w (E, rows, cols), x (n, cols) or (n, k, cols), ids (n, k)) -> (n, k, rows): x @ w[ids].T (ggml's MUL_MAT_ID)
    MUL_MAT_ID = "mul_mat_id"
    # (y (n, rows), x (n, cols), scales (n, S), a_0 (r_0, cols), b_0 (r_0, rows), a_1, b_1, ...) -> y plus, for
    # each adapter i and row t with scales[t, cols[i]] != 0, s * ((a_i x[t]) b_i), s = scale * alpha_i / r_i
    # (scale where alpha_i is 0; llama.cpp's build_lora_mm); a as the GGUF's lora_a, b its lora_b transposed;
    # params: cols, alphas. Rows without adapters are left as they are (LoRA adapters chosen per request)
    LORA = "lora", OpProps(inplace=(0,))
    # recurrent state (hybrid models). Source 0 is a layer's state cache (n_state_slots, ...): for
    # each sequence row i, the tokens [seq_off[i], seq_off[i+1]) run in order from the state in slot
    # state_slot[i], which is left holding the state after them; tokens in no range (padding) give 0.
    # An optional last source snap_slot (n,): where snap_slot[t] >= 0, the state after token t is
    # also copied to that slot (per-position snapshots of speculative verification rows)
    # (state (S, K-1, C), x (n, C), w (C, K), seq_off (n_seqs+1,), state_slot (n_seqs,)) -> (n, C):
    # causal depthwise conv over [state; x] (ggml's SSM_CONV), the last K-1 rows kept as the state
    SSM_CONV = "ssm_conv", OpProps(updates_state=True)
    # (state (S, H_v, d_v, d_k), q (n, H_k, d_k), k (n, H_k, d_k), v (n, H_v, d_v), g (n, H_v), beta (n, H_v),
    # seq_off, state_slot) -> (n, H_v, d_v): the gated delta rule (ggml's GATED_DELTA_NET); params: scale
    GATED_DELTA_NET = "gated_delta_net", OpProps(updates_state=True)
    # (state (S, H, P, N), x (n, H, P), dt (n, H), A (H,), B (n, G, N), C (n, G, N), seq_off, state_slot)
    # -> (n, H, P): Mamba-2's selective scan (ggml's SSM_SCAN; softplus of dt inside, no D skip)
    SSM_SCAN = "ssm_scan", OpProps(updates_state=True)
    # vision towers (core.array_ops)
    PATCHIFY = "patchify"    # (img (B, C, H, W),) -> (B*ny*nx, C*p*p): each p x p patch a row; params: p
    # (q (n, H, d), k (n, H_kv, d), v (n, H_kv, dv)[, seg (n,)]) -> (n, H*dv): attention with no mask,
    # each token over the tokens of its run of equal seg (one image, one window); params: scale
    ATTN_FULL = "attn_full"
    POOL_2D = "pool_2d"      # (x (B*ny*nx, E),) -> (B*(ny/k)*(nx/k), E): k x k average; params: nx, ny, k
    # fused ops (runtime.fusion rewrites into these)
    # (q, k_cache, v_cache, tok_seq, tok_pos, block_table[, seq_len]) -> (n_tokens, n_head*head_dim);
    # params: scale, block_size, window, causal, softcap, alibi (as KQ_MASK's)
    ATTN = "attn"
    RMS_NORM_MUL = "rms_norm_mul", OpProps(inplace=(0,))  # (x, w) = rms_norm(x) * w
    # (x, w, r) = rms_norm(x) * w + r (a post-norm into the residual)
    RMS_NORM_MUL_ADD = "rms_norm_mul_add", OpProps(inplace=(2, 0))
    GLU = "glu", OpProps(inplace=(0, 1))  # (gate, up) = act(gate) * up; params: act ("silu" | "gelu")
    FFN_GLU = "ffn_glu"      # (w_gate, w_up, x) = act(x @ w_gate.T) * (x @ w_up.T); params: act
    MUL_MAT_ADD = "mul_mat_add", OpProps(inplace=(2,))  # (w, x, r) = x @ w.T + r (a projection into the residual)
    # a projection with its LoRA adapters in one node (LORA over MUL_MAT / MUL_MAT_ADD / the gated FFN): the
    # same sources as the unfused op, then scales and the (a, b) pairs of each part; params: parts, a tuple
    # of (cols, alphas) per output the adapters go on (one; the FFN's two: gate's, then up's), its pairs in
    # that order. MUL_MAT_ADD_LORA adds the residual last, (x @ w.T + adapters) + r, as llama.cpp. A MUL_MAT_LORA
    # over stacked weights (q, k and v) has a part per weight and out_cols: the output columns (o0, o1) of each
    MUL_MAT_LORA = "mul_mat_lora"                                  # (w, x, scales, a_0, b_0, ...)
    MUL_MAT_ADD_LORA = "mul_mat_add_lora", OpProps(inplace=(2,))   # (w, x, r, scales, a_0, b_0, ...)
    FFN_GLU_LORA = "ffn_glu_lora"                                  # (w_gate, w_up, x, scales, ...); params: act too
    # (cache, x, pos, slots): cache[slots] = rope(x, pos); rope params
    ROPE_SET_ROWS = "rope_set_rows", OpProps(writes_cache=True)
    # multi-device (runtime.placement inserts it; runtime.dispatch runs it, not a backend kernel)
    COPY = "copy", OpProps(moves=True)  # (x,) -> the same values on this node's backend; params: src (backend it leaves)


def lora_split(node, values) -> tuple[tuple, object, list[tuple[tuple, tuple, tuple]]]:
    """A MUL_MAT_LORA / MUL_MAT_ADD_LORA / FFN_GLU_LORA node's source values as (the unfused op's, scales,
    [(cols, alphas, (a_0, b_0, a_1, ...)) per part])."""
    nb = 2 if node.op is Op.MUL_MAT_LORA else 3
    parts, i = [], nb + 1
    for cols, alphas in node.params["parts"]:
        parts.append((cols, alphas, tuple(values[i:i + 2 * len(cols)])))
        i += 2 * len(cols)
    return tuple(values[:nb]), values[nb], parts


@dataclass(eq=False)
class Tensor:
    op: Op
    srcs: tuple["Tensor", ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    name: str
    layer: int = -1
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if self.layer < 0 else f"{self.name}-{self.layer}"

    def __repr__(self) -> str:
        return f"Tensor({self.label}, {self.op.value}, {self.shape})"


F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def _rope_pos_fits(pos: Tensor, n_rot: int, comps) -> bool:
    """One position per token, or (multi-position RoPE) components each rotated pair picks one of."""
    if comps is None:
        return len(pos.shape) == 1
    return len(pos.shape) == 2 and len(comps) == n_rot // 2 and all(0 <= c < pos.shape[1] for c in comps)


class Graph:
    """Builds nodes; `outputs` are the nodes whose values the caller wants back."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self.outputs: list[Tensor] = []
        # (g, w, x, y, il) -> y with the step's LoRA adapters on it, or y: set by the model for steps
        # whose requests use adapters (model_zoo.adapters), so every weight's product takes them
        self.lora_hook = None

    def _add(self, op: Op, srcs, shape, name: str, il: int = -1, dtype=F32, **params) -> Tensor:
        t = Tensor(op, tuple(srcs), tuple(int(s) for s in shape), np.dtype(dtype), name, il, params)
        self.nodes.append(t)
        return t

    # leaves
    def input(self, name: str, shape, dtype=I32) -> Tensor:
        t = self._add(Op.INPUT, (), shape, name, dtype=dtype)
        self.inputs[name] = t
        return t

    def weight(self, w) -> Tensor:
        """`w` is a core.weights.QWeight; the node's name is the GGUF tensor name."""
        return self._add(Op.WEIGHT, (), w.shape, w.name, weight=w)

    def cache(self, name: str, shape, il: int) -> Tensor:
        return self._add(Op.CACHE, (), shape, name, il)

    # ops
    def get_rows(self, table: Tensor, ids: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.GET_ROWS, (table, ids), (ids.shape[0], *table.shape[1:]), name, il)

    def mul_mat(self, w: Tensor, x: Tensor, name: str, il: int = -1) -> Tensor:
        assert x.shape[-1] == w.shape[1], f"{name}: {x.shape} @ {w.shape}.T"
        y = self._add(Op.MUL_MAT, (w, x), (*x.shape[:-1], w.shape[0]), name, il)
        return y if self.lora_hook is None or w.op is not Op.WEIGHT else self.lora_hook(self, w, x, y, il)

    def lora(self, y: Tensor, x: Tensor, scales: Tensor, pairs, *, cols, alphas, name: str, il: int = -1) -> Tensor:
        """y + each adapter's low-rank product on the rows that use it (Op.LORA); pairs: (a, b) weight nodes,
        a (r, cols), b (r, rows)."""
        assert len(y.shape) == len(x.shape) == 2 and y.shape[0] == x.shape[0] == scales.shape[0], f"{name}"
        for a, b in pairs:
            assert a.shape == (b.shape[0], x.shape[1]) and b.shape[1] == y.shape[1], f"{name}: {a.shape} {b.shape}"
        srcs = (y, x, scales, *(t for p in pairs for t in p))
        return self._add(Op.LORA, srcs, y.shape, name, il, cols=tuple(int(c) for c in cols),
                         alphas=tuple(float(a) for a in alphas))

    def rms_norm(self, x: Tensor, eps: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.RMS_NORM, (x,), x.shape, name, il, eps=float(eps))

    def mul(self, a: Tensor, b: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.MUL, (a, b), np.broadcast_shapes(a.shape, b.shape), name, il)

    def add(self, a: Tensor, b: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.ADD, (a, b), np.broadcast_shapes(a.shape, b.shape), name, il)

    def scale(self, x: Tensor, s: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SCALE, (x,), x.shape, name, il, s=float(s))

    def silu(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SILU, (x,), x.shape, name, il)

    def gelu(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.GELU, (x,), x.shape, name, il)

    def tanh(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.TANH, (x,), x.shape, name, il)

    def sigmoid(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SIGMOID, (x,), x.shape, name, il)

    def softplus(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SOFTPLUS, (x,), x.shape, name, il)

    def clamp(self, x: Tensor, lo: float, hi: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.CLAMP, (x,), x.shape, name, il, lo=float(lo), hi=float(hi))

    def l2_norm(self, x: Tensor, eps: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.L2_NORM, (x,), x.shape, name, il, eps=float(eps))

    def reshape(self, x: Tensor, shape, name: str, il: int = -1) -> Tensor:
        assert int(np.prod(shape)) == int(np.prod(x.shape)), f"{name}: {x.shape} -> {shape}"
        return self._add(Op.RESHAPE, (x,), shape, name, il, dtype=x.dtype, new_shape=tuple(shape))

    def slice(self, x: Tensor, start: int, stop: int, name: str, il: int = -1) -> Tensor:
        assert 0 <= start < stop <= x.shape[-1], f"{name}: [{start}:{stop}] of {x.shape}"
        return self._add(Op.SLICE, (x,), (*x.shape[:-1], stop - start), name, il, start=int(start), stop=int(stop))

    def rope(self, x: Tensor, pos: Tensor, *, n_rot: int, base: float, freq_scale: float = 1.0,
             neox: bool, name: str, il: int = -1, freqs: tuple[float, ...] | None = None,
             mscale: float = 1.0, comps: tuple[int, ...] | None = None) -> Tensor:
        """`freqs` (n_rot/2) replace base and freq_scale (scaled RoPE: theta_i = pos * freqs[i]),
        `mscale` multiplies cos and sin; both are left out of params when unused. `comps` (n_rot/2):
        multi-position RoPE (ggml_rope_multi: M-RoPE, its interleaved and vision forms), pos being
        (n_tokens, P) position components and pair i rotated by pos[t, comps[i]] (model_zoo.rope)."""
        assert len(x.shape) == 3 and n_rot <= x.shape[2] and (freqs is None or len(freqs) == n_rot // 2)
        assert _rope_pos_fits(pos, n_rot, comps), f"{name}: positions {pos.shape}, comps {comps}"
        extra = {} if freqs is None and mscale == 1.0 else dict(
            freqs=None if freqs is None else tuple(float(f) for f in freqs), mscale=float(mscale))
        if comps is not None:
            extra["comps"] = tuple(int(c) for c in comps)
        return self._add(Op.ROPE, (x, pos), x.shape, name, il, n_rot=int(n_rot), base=float(base),
                         freq_scale=float(freq_scale), neox=bool(neox), **extra)

    def set_rows(self, cache: Tensor, src: Tensor, slots: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SET_ROWS, (cache, src, slots), cache.shape, name, il)

    # attention, unfused
    def gather_kv(self, cache: Tensor, block_table: Tensor, *, block_size: int, name: str, il: int = -1) -> Tensor:
        n_seqs, mb = block_table.shape
        return self._add(Op.GATHER_KV, (cache, block_table), (n_seqs, mb * block_size, *cache.shape[1:]),
                         name, il, block_size=int(block_size))

    def kq(self, q: Tensor, k: Tensor, tok_seq: Tensor, name: str, il: int = -1) -> Tensor:
        assert q.shape[2] == k.shape[3] and q.shape[1] % k.shape[2] == 0, f"{name}: {q.shape} vs {k.shape}"
        return self._add(Op.KQ, (q, k, tok_seq), (q.shape[0], q.shape[1], k.shape[1]), name, il)

    def attn_temp(self, pos: Tensor, *, floor: int, beta: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.ATTN_TEMP, (pos,), (pos.shape[0], 1, 1), name, il, floor=int(floor), beta=float(beta))

    def kq_mask(self, pos: Tensor, *, n_kv: int, window: int = 0, seq_len: Tensor | None = None,
                alibi: float = 0.0, n_head: int = 1, causal: bool | None = None, name: str, il: int = -1) -> Tensor:
        """seq_len given: non-causal (an encoder), each token sees its whole sequence (attn_bounds);
        with causal=True too, each token's horizon (tokens of an image that attend both ways).
        alibi > 0 (ggml's max_bias): ALiBi's per-head distance bias on the range, so one row per head."""
        srcs = (pos,) if seq_len is None else (pos, seq_len)
        return self._add(Op.KQ_MASK, srcs, (pos.shape[0], n_head if alibi > 0 else 1, n_kv), name, il,
                         window=int(window), causal=seq_len is None if causal is None else causal, alibi=float(alibi))

    def soft_max(self, x: Tensor, name: str, il: int = -1, sinks: Tensor | None = None) -> Tensor:
        """Over the last axis; sinks (n_head,) for scores (n_tokens, n_head, n_kv): one more logit per
        head in each row's denominator, with no value (ggml_soft_max_ext's sinks, gpt-oss)."""
        if sinks is None:
            return self._add(Op.SOFT_MAX, (x,), x.shape, name, il)
        assert len(x.shape) == 3 and sinks.shape == (x.shape[1],), f"{name}: sinks {sinks.shape} for {x.shape}"
        return self._add(Op.SOFT_MAX, (x, sinks), x.shape, name, il)

    def kqv(self, probs: Tensor, v: Tensor, tok_seq: Tensor, name: str, il: int = -1) -> Tensor:
        assert probs.shape[2] == v.shape[1], f"{name}: {probs.shape} vs {v.shape}"
        return self._add(Op.KQV, (probs, v, tok_seq), (probs.shape[0], probs.shape[1], v.shape[3]), name, il)

    def top_k(self, x: Tensor, k: int, name: str, il: int = -1) -> Tensor:
        assert len(x.shape) == 2 and 0 < k <= x.shape[1]
        return self._add(Op.TOP_K, (x,), (x.shape[0], k), name, il, dtype=I32, k=int(k))

    def take(self, x: Tensor, ids: Tensor, name: str, il: int = -1) -> Tensor:
        assert len(x.shape) == 2 and ids.shape[0] == x.shape[0]
        return self._add(Op.TAKE, (x, ids), ids.shape, name, il)

    def sum_rows(self, x: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.SUM_ROWS, (x,), (*x.shape[:-1], 1), name, il)

    def div(self, a: Tensor, b: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.DIV, (a, b), np.broadcast_shapes(a.shape, b.shape), name, il)

    def mul_mat_id(self, w: Tensor, x: Tensor, ids: Tensor, name: str, il: int = -1) -> Tensor:
        """Each token's x through the experts ids[t] selects of the stacked weights w."""
        n, k = ids.shape
        assert len(w.shape) == 3 and x.shape[-1] == w.shape[2] and x.shape[0] == n and x.shape[1:-1] in ((), (k,))
        return self._add(Op.MUL_MAT_ID, (w, x, ids), (n, k, w.shape[1]), name, il)

    def add_n(self, xs, name: str, il: int = -1) -> Tensor:
        return self._add(Op.ADD_N, tuple(xs), np.broadcast_shapes(*(x.shape for x in xs)), name, il)

    # recurrent state: `state` is a cache node; seq_off (n_seqs+1,), state_slot (n_seqs,) inputs
    # snap_slot (n_tokens,) or None: the slot each token's state is also copied to (-1: none)
    def ssm_conv(self, state: Tensor, x: Tensor, w: Tensor, seq_off: Tensor, state_slot: Tensor, *, name: str,
                 il: int = -1, snap_slot: Tensor | None = None) -> Tensor:
        n, c = x.shape
        assert w.shape == (c, state.shape[1] + 1) and state.shape[2] == c, f"{name}: {x.shape} {w.shape} {state.shape}"
        return self._add(Op.SSM_CONV, (state, x, w, seq_off, state_slot, *_snap(snap_slot, n)), (n, c), name, il)

    def gated_delta_net(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor,
                        seq_off: Tensor, state_slot: Tensor, *, scale: float, name: str, il: int = -1,
                        snap_slot: Tensor | None = None) -> Tensor:
        n, h_k, d_k = q.shape
        h_v, d_v = v.shape[1:]
        assert k.shape == q.shape and gate.shape == beta.shape == (n, h_v) and h_v % h_k == 0, f"{name}"
        assert state.shape[1:] == (h_v, d_v, d_k), f"{name}: state {state.shape}"
        return self._add(Op.GATED_DELTA_NET, (state, q, k, v, gate, beta, seq_off, state_slot, *_snap(snap_slot, n)),
                         v.shape, name, il, scale=float(scale))

    def ssm_scan(self, state: Tensor, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, seq_off: Tensor,
                 state_slot: Tensor, *, name: str, il: int = -1, snap_slot: Tensor | None = None) -> Tensor:
        n, h, p = x.shape
        g, d_state = b.shape[1:]
        assert dt.shape == (n, h) and a.shape[-1] == h and c.shape == b.shape and h % g == 0, f"{name}"
        assert state.shape[1:] == (h, p, d_state), f"{name}: state {state.shape}"
        return self._add(Op.SSM_SCAN, (state, x, dt, a, b, c, seq_off, state_slot, *_snap(snap_slot, n)), x.shape,
                         name, il)

    # vision towers
    def patchify(self, img: Tensor, p: int, name: str) -> Tensor:
        b, c, h, w = img.shape
        return self._add(Op.PATCHIFY, (img,), (b * (h // p) * (w // p), c * p * p), name, p=int(p))

    def attn_full(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, seg: Tensor | None = None, name: str,
                  il: int = -1) -> Tensor:
        assert q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] % k.shape[1] == 0, f"{name}: {q.shape} {k.shape}"
        srcs = (q, k, v) if seg is None else (q, k, v, seg)
        return self._add(Op.ATTN_FULL, srcs, (q.shape[0], q.shape[1] * v.shape[2]), name, il, scale=float(scale))

    def pool_2d(self, x: Tensor, *, nx: int, ny: int, k: int, name: str) -> Tensor:
        b = x.shape[0] // (nx * ny)
        assert b * nx * ny == x.shape[0], f"{name}: {x.shape[0]} rows are not images of {ny}x{nx} patches"
        return self._add(Op.POOL_2D, (x,), (b * (ny // k) * (nx // k), x.shape[1]), name, nx=int(nx), ny=int(ny),
                         k=int(k))

    # fused ops: created by runtime.fusion, or directly by tests
    def attn(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, tok_seq: Tensor, tok_pos: Tensor,
             block_table: Tensor, *, scale: float, block_size: int, window: int = 0, softcap: float = 0.0,
             alibi: float = 0.0, seq_len: Tensor | None = None, sinks: Tensor | None = None,
             causal: bool | None = None, name: str, il: int = -1) -> Tensor:
        """Attention of each query token over its own sequence's cached positions in its range
        (attn_bounds: causal, or with seq_len the whole sequence), read through the block table
        (paged KV). Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap > 0,
        then - alibi_slopes(n_head, alibi)[h] * |p - pos| when alibi > 0 (ALiBi, in place of RoPE);
        sinks (n_head,): each head's extra logit in the softmax's denominator (the last source)."""
        n_tokens, n_head, head_dim = q.shape
        srcs = ((q, k_cache, v_cache, tok_seq, tok_pos, block_table) + (() if seq_len is None else (seq_len,))
                + (() if sinks is None else (sinks,)))
        return self._add(Op.ATTN, srcs, (n_tokens, n_head * v_cache.shape[2]), name, il, scale=float(scale),
                         block_size=int(block_size), window=int(window), softcap=float(softcap),
                         alibi=float(alibi), causal=seq_len is None if causal is None else causal,
                         sinks=sinks is not None)

    def rms_norm_mul(self, x: Tensor, w: Tensor, eps: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.RMS_NORM_MUL, (x, w), x.shape, name, il, eps=float(eps))

    def rms_norm_mul_add(self, x: Tensor, w: Tensor, r: Tensor, eps: float, name: str, il: int = -1) -> Tensor:
        return self._add(Op.RMS_NORM_MUL_ADD, (x, w, r), r.shape, name, il, eps=float(eps))

    def glu(self, gate: Tensor, up: Tensor, act: str, name: str, il: int = -1, *, alpha: float = 1.702,
            limit: float = 7.0) -> Tensor:
        """act(gate) * up; act "swiglu_oai" (gpt-oss, ggml's swiglu_oai): gate clamped above at limit,
        up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)."""
        if act == "swiglu_oai":
            return self._add(Op.GLU, (gate, up), gate.shape, name, il, act=act, alpha=float(alpha), limit=float(limit))
        return self._add(Op.GLU, (gate, up), gate.shape, name, il, act=act)

    def ffn_glu(self, w_gate: Tensor, w_up: Tensor, x: Tensor, act: str, name: str, il: int = -1) -> Tensor:
        assert w_gate.shape == w_up.shape and x.shape[-1] == w_gate.shape[1]
        return self._add(Op.FFN_GLU, (w_gate, w_up, x), (*x.shape[:-1], w_gate.shape[0]), name, il, act=act)

    def mul_mat_add(self, w: Tensor, x: Tensor, r: Tensor, name: str, il: int = -1) -> Tensor:
        return self._add(Op.MUL_MAT_ADD, (w, x, r), r.shape, name, il)

    def proj_lora(self, op: Op, base, scales: Tensor, parts, name: str, il: int = -1, **params) -> Tensor:
        """A MUL_MAT_LORA / MUL_MAT_ADD_LORA / FFN_GLU_LORA node: `base` the unfused op's sources, `parts`
        [(pairs, cols, alphas)] per output the adapters go on (see Op.MUL_MAT_LORA)."""
        w, x = base[0], base[-1] if op is not Op.MUL_MAT_ADD_LORA else base[1]
        shape = base[2].shape if op is Op.MUL_MAT_ADD_LORA else (*x.shape[:-1], w.shape[0])
        out_cols = params.get("out_cols") or ((0, w.shape[0]),) * len(parts)
        for (pairs, _, _), (o0, o1) in zip(parts, out_cols):
            for a, b in pairs:
                assert a.shape == (b.shape[0], x.shape[-1]) and b.shape[1] == o1 - o0, f"{name}: {a.shape} {b.shape}"
        srcs = (*base, scales, *(t for pairs, _, _ in parts for p in pairs for t in p))
        return self._add(op, srcs, shape, name, il, **params, parts=tuple(
            (tuple(int(c) for c in cols), tuple(float(a) for a in alphas)) for _, cols, alphas in parts))

    def rope_set_rows(self, cache: Tensor, x: Tensor, pos: Tensor, slots: Tensor, *, name: str, il: int = -1,
                      **rope) -> Tensor:
        assert _rope_pos_fits(pos, rope["n_rot"], rope.get("comps")), f"{name}: positions {pos.shape}"
        return self._add(Op.ROPE_SET_ROWS, (cache, x, pos, slots), cache.shape, name, il, **rope)

    def copy(self, x: Tensor, *, src: str, dst: str) -> Tensor:
        """x's value moved from backend `src` to `dst` (ggml's split input, named as ggml does)."""
        return self._add(Op.COPY, (x,), x.shape, f"{x.name}#{dst}", x.layer, x.dtype, src=src)

    def dump(self, backends: list[str] | None = None) -> str:
        """A table of the nodes; `backends`: each node's, where the graph is placed."""
        rows = [f"{'#':>4}  {'node':<24} {'op':<16} {'shape':<22} {'dtype':<8} backend"]
        for i, t in enumerate(self.nodes):
            where = backends[i] if backends else ""
            rows.append(f"{i:>4}  {t.label:<24} {t.op.value:<16} {str(t.shape):<22} {str(t.dtype):<8} {where}")
        return "\n".join(rows)


def _snap(snap_slot: Tensor | None, n: int) -> tuple[Tensor, ...]:
    """A recurrent op's optional snapshot-slot source, checked against its token count."""
    if snap_slot is None:
        return ()
    assert snap_slot.shape == (n,), f"snap_slot {snap_slot.shape} for {n} tokens"
    return (snap_slot,)
