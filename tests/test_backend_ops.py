"""Every op on every backend against the numpy reference, as llama.cpp's test-backend-ops:
NMSE < 5e-4 for products and attention, 1e-7 elsewhere. Kernels are called directly, node
by node (not through runtime.dispatch): without an out= buffer, and where the backend plans
memory, with a fresh one and with a source's own buffer (in place). Shapes are the real
models' (K = 576, 640, 896, 1536; head_dim 64, 128, 256; GQA 9/3, 4/1, 14/2), token counts
0 (an empty batch), 1, a few and more than 16, in every weight type a backend takes.

Backends: `cpu` always, `cuda` where CuPy sees a device (else skipped, saying why).
HEARTHLM_TEST_BACKENDS=cuda (a comma list) runs only those, and then a missing one fails."""
from __future__ import annotations

import math
import os
import zlib
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends import get_backend
from hearthlm.backends.random_blocks import IQUANTS, random_blocks
from hearthlm.backends.reference import ReferenceBackend, dequantize
from hearthlm.core import array_ops
from hearthlm.core.errors import BackendError
from hearthlm.core.graph import Graph, Op
from hearthlm.core.weights import QWeight

# NMSE < 5e-4; else 1e-7
PRODUCTS = {Op.MUL_MAT, Op.MUL_MAT_ADD, Op.FFN_GLU, Op.MUL_MAT_ID, Op.ATTN, Op.KQ, Op.KQV, Op.GATED_DELTA_NET,
            Op.ATTN_FULL, Op.LORA, Op.MUL_MAT_LORA, Op.MUL_MAT_ADD_LORA, Op.FFN_GLU_LORA}
NOT_KERNELS = {Op.INPUT, Op.WEIGHT, Op.CACHE, Op.COPY}  # bound leaves, and dispatch's copies
FLOATS = [T.F32, T.F16, T.BF16]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
BASE_TYPES = FLOATS + LEGACY + KQUANTS
TYPES = BASE_TYPES + list(IQUANTS)
KS = [576, 640, 896, 1536]  # n_embd of SmolLM2-135M, Gemma-3-270M, Qwen2.5-0.5B; SmolLM2's n_ff
KQUANT_KS = [1536, 2048]  # K-quant rows are whole 256-blocks (llama.cpp falls back elsewhere)
SUPER = {*KQUANTS, *(t for t in IQUANTS if GGML_QUANT_SIZES[t][0] == 256)}  # 256-weight blocks
TOKENS = [0, 1, 5, 17]
TOKENS_MM = [0, 1, 5, 8, 17]  # 8: the most cuda's mmvq takes; the CPU kernels take tokens in pairs
GQA = [(9, 3, 64), (4, 1, 256), (14, 2, 64), (8, 2, 128)]  # (n_head, n_head_kv, head_dim)
REF = ReferenceBackend()


# ---- backends ----

def _names() -> list[str]:
    env = os.environ.get("HEARTHLM_TEST_BACKENDS", "")
    return [n.strip() for n in env.split(",") if n.strip()] or ["cpu", "cuda"]


@pytest.fixture(scope="module", params=_names())
def backend(request):
    try:
        return get_backend(request.param)
    except BackendError as e:
        if os.environ.get("HEARTHLM_TEST_BACKENDS"):  # asked for by name: its absence is no pass
            pytest.fail(f"HEARTHLM_TEST_BACKENDS names {request.param}, which is unavailable: {e}")
        pytest.skip(f"{request.param}: {e}")


# ---- weights (made once per module: quantizing is the slow part) ----

def make_raw(qtype, n_rows, n_cols, rng) -> np.ndarray:
    """Raw GGUF bytes (n_rows, row_bytes): quantized normals, or (gguf cannot quantize
    K-quants) random K-quant blocks with sane float16 scales."""
    if qtype in KQUANTS or qtype in IQUANTS:
        raw = random_blocks(qtype, n_rows, n_cols, rng)
    else:
        w = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        raw = w.view(np.uint8) if qtype == T.F32 else quants.quantize(w, qtype).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(n_rows, -1))


@lru_cache(maxsize=None)
def qweight(qtype, n_rows: int, n_cols: int, seed: int = 0) -> QWeight:
    raw = make_raw(qtype, n_rows, n_cols, np.random.default_rng([int(qtype), n_rows, n_cols, seed]))
    return QWeight(f"{T(qtype).name}-{n_rows}x{n_cols}-{seed}", int(qtype), (n_rows, n_cols), raw)


@lru_cache(maxsize=None)
def vec_weight(n: int, seed: int = 0) -> QWeight:
    """A norm's weight: a float32 vector near 1."""
    a = (1 + 0.1 * np.random.default_rng([n, seed]).standard_normal(n)).astype(np.float32)
    return QWeight(f"vec-{n}-{seed}", int(T.F32), (n,), a.reshape(1, -1).view(np.uint8))


_rms: dict[str, float] = {}


def x_for(w: QWeight, rng, n: int) -> np.ndarray:
    """Activations that make x @ w.T ~ N(0, 1) whatever w's type and scale."""
    if w.name not in _rms:
        _rms[w.name] = float(np.sqrt(np.mean(dequantize(w).astype(np.float64) ** 2)))
    return f32(rng, n, w.shape[1], scale=1 / (_rms[w.name] * np.sqrt(w.shape[1])))


_prepared: dict[tuple[str, str], object] = {}


def prepared(be, w: QWeight):
    key = (be.name, w.name)
    if key not in _prepared:
        _prepared[key] = be.prepare_weight(w)
    return _prepared[key]


# ---- running a graph's kernels one by one ----

def state_caches(g: Graph) -> set[str]:
    """The caches that ops updating recurrent state take as source 0: float32 on every backend."""
    return {n.srcs[0].name for n in g.nodes if n.op.props.updates_state}


def run_graph(be, g: Graph, feed, caches, mode: str, states: dict | None = None) -> list[np.ndarray]:
    """mode "alloc": kernels allocate; "out": each gets a NaN-filled buffer (an unwritten
    element shows); "inplace": an op that may take a source's buffer writes over it.
    `states`, where given, receives the recurrent-state caches as the graph left them."""
    users = Counter(id(s) for n in g.nodes for s in n.srcs)
    in_state = state_caches(g)
    vals = {}
    for node in g.nodes:
        op = node.op
        if op is Op.INPUT:
            v = be.from_host(np.array(feed[node.name]))  # a copy: "inplace" may write over it
        elif op is Op.WEIGHT:
            v = prepared(be, node.params["weight"])
        elif op is Op.CACHE:  # a copy: kernels write caches in place
            v = be.from_host(caches[node.name].astype(np.float32 if node.name in in_state else be.kv_dtype))
        else:
            srcs = [vals[id(s)] for s in node.srcs]
            out = None
            if mode != "alloc" and not (op.props.view or op.props.writes_cache):
                out = np.full(node.shape, np.nan, np.float32)
                for i in op.props.inplace if mode == "inplace" else ():
                    s = node.srcs[i]
                    if s.op is Op.INPUT and users[id(s)] == 1 and s.shape == node.shape and s.dtype == np.float32:
                        out = srcs[i]
                        break
            k = be.bind(node)  # as runtime.dispatch calls it: bound once to its node
            v = k(*srcs) if out is None else k(*srcs, out=out)
            assert out is None or v is out, f"{node.label}: the kernel did not return its out= buffer"
            assert tuple(v.shape) == node.shape, f"{node.label}: shape {v.shape}, not {node.shape}"
        vals[id(node)] = v
    if states is not None:
        states.update({n.name: np.asarray(be.to_host(vals[id(n)])) for n in g.nodes if n.name in in_state})
    return [np.asarray(be.to_host(vals[id(o)]), np.float32) for o in g.outputs]


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def check(be, g: Graph, feed, caches=None):
    for n in g.nodes:
        if not be.supports(n):
            what = T(n.params["weight"].ggml_type).name if n.op is Op.WEIGHT else f"{n.op.value} {n.shape}"
            pytest.skip(f"{be.name} does not run {what}")
    kv = np.dtype(be.kv_dtype)
    # both backends read the cache's values as this backend holds them (float16 on some CPUs);
    # recurrent states are float32 everywhere
    in_state = state_caches(g)
    caches = {k: c if k in in_state else c.astype(kv).astype(np.float32) for k, c in (caches or {}).items()}
    want_states: dict = {}
    want = run_graph(REF, g, feed, caches, "alloc", want_states)
    check_untouched_slots(g, feed, caches, want_states)
    tol = 5e-4 if any(n.op in PRODUCTS for n in g.nodes) else 1e-7
    for mode in ("alloc", "out", "inplace") if be.plans_memory else ("alloc",):
        states: dict = {}
        outs = run_graph(be, g, feed, caches, mode, states)
        check_untouched_slots(g, feed, caches, states)
        for name, ref in want_states.items():
            e = nmse(states[name], ref)
            assert e < tol, f"{mode}: state {name} NMSE {e:.2e} >= {tol:g}"
        for o, got, ref in zip(g.outputs, outs, want):
            if o.op.props.writes_cache:  # what a cache of kv_dtype can hold of the reference's write
                ref = ref.astype(kv).astype(np.float32)
            assert got.shape == ref.shape == o.shape, (mode, o.label, got.shape, ref.shape)
            masked = np.isinf(ref)  # -inf where attention masks: exactly there
            assert np.array_equal(got[masked], ref[masked]) and not np.isinf(got[~masked]).any(), (mode, o.label)
            e = nmse(got[~masked], ref[~masked])
            assert e < tol, f"{mode}: {o.label} NMSE {e:.2e} >= {tol:g}"


def check_untouched_slots(g: Graph, feed, caches, states):
    """A state slot that no sequence row with tokens names, nor any token's snapshot, is left
    exactly as it was."""
    for n in g.nodes:
        if n.op.props.updates_state:
            src = {s.name: feed[s.name] for s in n.srcs if s.name in ("seq_off", "state_slot", "snap_slot")}
            name, seq_off, slots = n.srcs[0].name, src["seq_off"], src["state_slot"]
            ran = {int(s) for i, s in enumerate(slots) if seq_off[i + 1] > seq_off[i]}
            ran |= {int(s) for s in src.get("snap_slot", ()) if s >= 0}
            kept = [s for s in range(len(caches[name])) if s not in ran]
            assert np.array_equal(states[name][kept], caches[name][kept]), f"{n.label}: slots {kept} changed"


# ---- cases: each builds (graph, feed, caches) ----

def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def f32(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def inputs(g: Graph, **arrays):
    return [g.input(name, a.shape, a.dtype) for name, a in arrays.items()]


def mul_mat(qtype, k, n):
    w, x = qweight(qtype, 67, k), f32(rng_for("mm", qtype, k, n), n, k)  # 67 rows: a partial row tile
    g = Graph()
    g.outputs.append(g.mul_mat(g.weight(w), *inputs(g, x=x), "y"))
    return g, {"x": x}, {}


def mul_mat_add(qtype, n, k=None):
    """k < 32: a weight narrower than a quant block, which the CPU backend keeps as a float32 array."""
    rng, k = rng_for("mma", qtype, n), k or (KQUANT_KS[0] if qtype in SUPER else 896)
    w = qweight(qtype, 67, k)
    x, r = x_for(w, rng, n), f32(rng, n, 67)  # the residual no bigger than the product: both count
    g = Graph()
    xi, ri = inputs(g, x=x, r=r)
    g.outputs.append(g.mul_mat_add(g.weight(w), xi, ri, "y"))
    return g, {"x": x, "r": r}, {}


def ffn_glu(qtype, n, act, n_ff=600, k=None):
    """n_ff = 600: more than one CPU slab (ffn.CHUNK = 512), the last one partial. k < 32: weights narrower
    than a quant block, kept float32 by the CPU backend (a converted tiny model's FFN)."""
    k = k or (KQUANT_KS[0] if qtype in SUPER else 576)
    wg, wu = qweight(qtype, n_ff, k, 0), qweight(qtype, n_ff, k, 1)
    x = 2 * x_for(wg, rng_for("ffn", qtype, n, act), n)  # gate ~ N(0, 4): both sides of the activation's bend
    g = Graph()
    g.outputs.append(g.ffn_glu(g.weight(wg), g.weight(wu), *inputs(g, x=x), act, "f"))
    return g, {"x": x}, {}


def get_rows(qtype, n):
    k = KQUANT_KS[0] if qtype in SUPER else 640
    ids = rng_for("gr", qtype, n).integers(0, 97, n).astype(np.int32)
    ids[:2] = [96, 96][:n]  # the last row, repeated
    g = Graph()
    g.outputs.append(g.get_rows(g.weight(qweight(qtype, 97, k)), *inputs(g, ids=ids), "rows"))
    return g, {"ids": ids}, {}


def get_rows_act(n_out):
    """The output rows of the hidden states: none when a prompt chunk wants no logits."""
    rng = rng_for("gra", n_out)
    h, ids = f32(rng, 20, 576), rng.integers(0, 20, n_out).astype(np.int32)
    g = Graph()
    g.outputs.append(g.get_rows(*inputs(g, h=h, ids=ids), "out_rows"))
    return g, {"h": h, "ids": ids}, {}


def norm(kind, n, k=576):
    rng = rng_for("norm", kind, n, k)
    x, r = f32(rng, n, k, scale=3), f32(rng, n, k)
    g = Graph()
    xi, ri = inputs(g, x=x, r=r)
    g.outputs.append({
        "rms_norm": lambda: g.rms_norm(xi, 1e-5, "n"),
        "rms_norm_mul": lambda: g.rms_norm_mul(xi, g.weight(vec_weight(k)), 1e-5, "n"),
        # Gemma-3's per-head q/k norms
        "rms_norm_mul_heads": lambda: g.rms_norm_mul(g.reshape(xi, (n, k // 64, 64), "heads"),
                                                     g.weight(vec_weight(64)), 1e-6, "n"),
        "rms_norm_mul_add": lambda: g.rms_norm_mul_add(xi, g.weight(vec_weight(k)), ri, 1e-6, "n"),
    }[kind]())
    return g, {"x": x, "r": r}, {}


def elementwise(kind, n, k=576):
    rng = rng_for("ew", kind, n, k)
    a = {"x": f32(rng, n, k, scale=3), "y": f32(rng, n, k), "z": f32(rng, n, k), "v": f32(rng, k),
         "s": f32(rng, n, 9, 64), "m": f32(rng, n, 1, 64), "qkv": f32(rng, n, 3 * k)}
    g = Graph()
    x, y, z, v, s, m, qkv = inputs(g, **a)
    g.outputs.append({
        "mul": lambda: g.mul(x, v, "m"),
        "add": lambda: g.add(x, y, "a"),
        "add_bcast": lambda: g.add(s, m, "a"),
        "add_n3": lambda: g.add_n([x, y, z], "a"),
        "add_n4": lambda: g.add_n([x, y, z, x], "a"),
        "scale": lambda: g.scale(x, 0.125, "s"),
        "silu": lambda: g.silu(x, "s"),
        "gelu": lambda: g.gelu(x, "s"),
        "tanh": lambda: g.tanh(x, "t"),
        "sigmoid": lambda: g.sigmoid(x, "s"),
        "softplus": lambda: g.softplus(g.scale(x, 8.0, "x8"), "s"),  # past the threshold of 20 both ways
        "clamp": lambda: g.clamp(x, -1.5, 2.0, "c"),  # x ~ 3 N(0, 1): clamped both ways, most not
        "l2_norm": lambda: g.l2_norm(s, 1e-6, "n"),  # per head, as Gated DeltaNet's q and k
        "l2_norm_tiny": lambda: g.l2_norm(g.scale(s, 1e-9, "tiny"), 1e-6, "n"),  # norms below eps
        "swiglu": lambda: g.glu(x, y, "silu", "s"),
        "geglu": lambda: g.glu(x, y, "gelu", "s"),
        # gpt-oss's clamped SwiGLU: gates past the limit (7) above, ups past it both ways
        "swiglu_oai": lambda: g.glu(g.scale(x, 3.0, "x3"), g.scale(y, 9.0, "y9"), "swiglu_oai", "s", alpha=1.702, limit=7.0),
        "reshape": lambda: g.reshape(x, (n, 9, 64), "r"),
        "slice": lambda: g.slice(qkv, k, 2 * k - 64, "k"),
    }[kind]())
    return g, a, {}


def rope(n, head_dim, n_rot, neox, base, freq_scale):
    rng = rng_for("rope", n, head_dim, n_rot, neox)
    x, pos = f32(rng, n, 3, head_dim), rng.integers(0, 5000, n).astype(np.int32)
    g = Graph()
    xi, pi = inputs(g, x=x, pos=pos)
    g.outputs.append(g.rope(xi, pi, n_rot=n_rot, base=base, freq_scale=freq_scale, neox=neox, name="r"))
    return g, {"x": x, "pos": pos}, {}


def rope_scaled(n, neox):
    """Scaled RoPE (YaRN, Llama 3, LongRoPE): per-dimension frequencies and a cos/sin magnitude."""
    rng = rng_for("rope_scaled", n, neox)
    x, pos = f32(rng, n, 4, 64), rng.integers(0, 5000, n).astype(np.int32)
    freqs = tuple(10000.0 ** (-np.arange(16) / 16) / np.linspace(1, 8, 16))
    g = Graph()
    xi, pi = inputs(g, x=x, pos=pos)
    g.outputs.append(g.rope(xi, pi, n_rot=32, base=1e4, neox=neox, name="r", freqs=freqs, mscale=1.2))
    return g, {"x": x, "pos": pos}, {}


def rope_multi(n, head_dim, n_rot, neox, n_comp, freqs=False):
    """Multi-position RoPE (ggml_rope_multi): pair i turns by component comps[i] of its token's
    positions (M-RoPE's t, h, w, e; a tower's y, x), with per-pair frequencies where given (the
    towers' restarting runs)."""
    rng = rng_for("rope_multi", n, head_dim, n_rot, neox, n_comp)
    x, pos = f32(rng, n, 3, head_dim), rng.integers(0, 5000, (n, n_comp)).astype(np.int32)
    comps = tuple(int(c) for c in rng.integers(0, n_comp, n_rot // 2))
    f = tuple(10000.0 ** (-(np.arange(n_rot // 2) % (n_rot // 4)) / (n_rot // 4))) if freqs else None
    g = Graph()
    xi, pi = inputs(g, x=x, pos=pos)
    g.outputs.append(g.rope(xi, pi, n_rot=n_rot, base=1e4, neox=neox, name="r", comps=comps, freqs=f))
    return g, {"x": x, "pos": pos}, {}


def lora(n, k=896, rows=67, ranks=(16, 8), qtype=T.F32):
    """Two LoRA adapters (alpha 32, and 0: the scale alone) on y; rows use one, both or none
    (scale 0: untouched); a third column of scales that no adapter of this weight reads. F16:
    the adapters' matrices kept as halves. Mutation: the cpu backend applying only a node's first
    adapter fails these."""
    rng = rng_for("lora", n, k)
    dt = np.float16 if qtype == T.F16 else np.float32
    y, x = f32(rng, n, rows), f32(rng, n, k, scale=1 / np.sqrt(k))
    s = np.zeros((n, 3), np.float32)
    s[0::3, 0], s[1::3, 2], s[2::3, 0], s[2::3, 2], s[:, 1] = 1.0, 0.5, 0.7, 2.0, 3.0
    g = Graph()
    yi, xi, si = inputs(g, y=y, x=x, s=s)
    pairs = [(g.weight(QWeight(f"a{r}{qtype.name}", qtype, (r, k), f32(rng, r, k).astype(dt).view(np.uint8).reshape(r, -1))),
              g.weight(QWeight(f"b{r}{qtype.name}", qtype, (r, rows), f32(rng, r, rows, scale=r ** -0.5).astype(dt)
                               .view(np.uint8).reshape(r, -1)))) for r in ranks]
    g.outputs.append(g.lora(yi, xi, si, pairs, cols=(0, 2)[:len(ranks)], alphas=(32.0, 0.0)[:len(ranks)], name="y_lora"))
    return g, {"y": y, "x": x, "s": s}, {}


def proj_lora(kind, qtype, n, ad=T.F16, mixed=False, first="one"):
    """A projection and its adapters in one node: MUL_MAT_LORA ("mm"; "stack2"/"stack3": over stacked weights, each
    part's adapters on its columns), MUL_MAT_ADD_LORA ("add"), FFN_GLU_LORA with adapters on gate and up ("ffn")
    or up alone ("ffn_up"). Rows use adapter 0, 1, both or none; `mixed`:
    the adapters of a part F32 and F16 (two kernel groups); `first`: the first row using adapter 0 ("one": the
    cpu backend's one-token call for n = 1), both, or none.
    Mutations: the cpu one-token kernel skipping the FFN's up adapter (4 cases fail), adding the residual twice
    (5 fail), or putting a stack's second adapter on the third part's columns (4 fail)."""
    rng = rng_for("proj_lora", kind, qtype, n, ad, mixed)
    k, rows = (KQUANT_KS[0] if qtype in SUPER else 576), 96
    x = x_for(qweight(qtype, rows, k), rng, n)
    s = np.zeros((n, 3), np.float32)
    s[0::3, 0], s[1::3, 2], s[2::3, 0], s[2::3, 2] = 1.0, 0.5, 0.7, 2.0
    s[:1] = np.array({"one": [1.0, 0, 0], "both": [0.7, 0, 2.0], "none": [0, 0, 0]}[first])[None, :][:n]

    def pairs(tag, ranks=(16, 8), width=rows):
        out = []
        for j, r in enumerate(ranks):
            t = T.F32 if mixed and j == 1 else ad
            dt = np.float16 if t == T.F16 else np.float32
            out.append((g.weight(QWeight(f"{tag}a{r}-{k}-{t.name}", t, (r, k), f32(rng, r, k).astype(dt).view(np.uint8).reshape(r, -1))),
                        g.weight(QWeight(f"{tag}b{r}-{width}-{t.name}", t, (r, width), f32(rng, r, width, scale=r ** -0.5)
                                         .astype(dt).view(np.uint8).reshape(r, -1)))))
        return out, (0, 2), (32.0, 0.0)
    g = Graph()
    feed = {"x": x, "s": s}
    if kind == "add":
        feed["r"] = f32(rng, n, rows)
    ins = inputs(g, **feed)
    xi, si = ins[0], ins[1]
    w = lambda seed: g.weight(qweight(qtype, rows, k, seed))  # noqa: E731
    if kind == "mm":
        node = g.proj_lora(Op.MUL_MAT_LORA, (w(0), xi), si, [pairs("q")], "y")
    elif kind.startswith("stack"):  # q, k (and v) stacked: 96 rows as 64 + 32 or 64 + 16 + 16, an adapter set each
        widths = (64, 32) if kind == "stack2" else (64, 16, 16)
        ends = np.cumsum((0, *widths))
        node = g.proj_lora(Op.MUL_MAT_LORA, (w(0), xi), si, [pairs(f"s{j}", width=wd) for j, wd in enumerate(widths)],
                           "y", out_cols=tuple((int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])))
    elif kind == "add":
        node = g.proj_lora(Op.MUL_MAT_ADD_LORA, (w(0), xi, ins[2]), si, [pairs("o")], "y")
    else:
        node = g.proj_lora(Op.FFN_GLU_LORA, (w(0), w(1), xi), si,
                           [pairs("g") if kind == "ffn" else ([], (), ()), pairs("u")], "f", act="silu")
    g.outputs.append(node)
    return g, feed, {}


def moe_routing(n, n_exp=16, k=3):
    """The router's part of a MoE FFN: top_k (largest first), take, sum_rows, div."""
    x = f32(rng_for("moe", n), n, n_exp)
    g = Graph()
    (xi,) = inputs(g, x=x)
    ids = g.top_k(xi, k, "ids")
    w = g.take(xi, ids, "w")
    g.outputs += [ids, g.div(w, g.sum_rows(w, "s"), "wn")]
    return g, {"x": x}, {}


@lru_cache(maxsize=None)
def experts(qtype, n_exp=6, rows=24, cols=256) -> QWeight:
    w = qweight(qtype, n_exp * rows, cols, 7)
    return QWeight(f"exps-{w.name}", w.ggml_type, (n_exp, rows, cols), w.raw)


def mul_mat_id(qtype, n, per_slot):
    """Expert matmul: x (n, cols), or one per slot (n, k, cols), through the experts ids select."""
    w, k = experts(qtype), 2
    rng = rng_for("mmid", qtype, n, per_slot)
    x = f32(rng, *((n, k, 256) if per_slot else (n, 256)), scale=0.1)
    ids = np.array([[0, 3], [3, 5], [5, 0], [3, 0], [5, 3]] * 4, np.int32)[:n]  # experts 1, 2, 4 unused
    g = Graph()
    xi, ii = inputs(g, x=x, ids=ids)
    g.outputs.append(g.mul_mat_id(g.weight(w), xi, ii, "y"))
    return g, {"x": x, "ids": ids}, {}


# paged KV: 3 sequences over scattered blocks of 16; a scenario is each token's (sequence, position)
BS, N_BLOCKS = 16, 9
BT = np.array([[5, 2, 7, 0], [1, 6, 3, 0], [4, 8, 0, 0]], np.int32)
SCENARIOS = {
    "empty": ([], []),
    "decode": ([0, 1, 2], [40, 7, 0]),
    "chunk": ([0] * 5 + [1], [20, 21, 22, 23, 24, 33]),  # a prefill chunk beside a decode token
    "prefill": ([2] * 20, list(range(10, 30))),  # 20 tokens after a cached prefix of 10
    "encode": ([0] * 13 + [1] * 7, [*range(13), *range(7)]),  # two whole inputs of an encoder
}


def scenario(name):
    seq, pos = (np.asarray(a, np.int32) for a in SCENARIOS[name])
    slots = (BT[seq, pos // BS] * BS + pos % BS).astype(np.int32)
    return seq, pos, slots


def kv_write(fused, n_kv, d, scen, neox=True, mrope=False):
    """K written into the cache (fused: rotated on the way; mrope: by M-RoPE's 4 components each)."""
    seq, pos, slots = scenario(scen)
    rng = rng_for("kvw", fused, n_kv, d, scen)
    cache, x = f32(rng, N_BLOCKS * BS, n_kv, d), f32(rng, len(seq), n_kv, d)
    rope = dict(n_rot=d, base=1e4, freq_scale=1.0, neox=neox)
    if mrope:  # an image's rows: positions past the first, comps interleaved t, h, w
        pos = (pos[:, None] + rng.integers(0, 9, (len(pos), 4)) * [0, 1, 1, 0]).astype(np.int32)
        rope["comps"] = tuple(i % 3 for i in range(d // 2))
    g = Graph()
    c = g.cache("cache_k", cache.shape, 0)
    xi, pi, si = inputs(g, x=x, pos=pos, slots=slots)
    g.outputs.append(g.rope_set_rows(c, xi, pi, si, name="kw", **rope) if fused else g.set_rows(c, xi, si, "kw"))
    return g, {"x": x, "pos": pos, "slots": slots}, {"cache_k": cache}


def attention(part, shape, scen, window, softcap=0.0, causal=True, alibi=0.0, sinks=False):
    """The fused ATTN, or one unfused part, over a scenario's tokens and random cached K/V;
    causal=False: an encoder's mask, each token over its whole sequence (its last position + 1);
    causal="image": causal, but tokens 3..8 (an image that attends both ways) see up to its last
    (a horizon per token: mutation, the cpu flash kernel's causal fast path ignoring it, fails);
    alibi: ALiBi's max_bias (the mask then per head); sinks: a logit per head in each softmax (gpt-oss)."""
    n_head, n_kv, d = shape
    seq, pos, _ = scenario(scen)
    n, width = len(seq), BT.shape[1] * BS
    rng = rng_for("attn", part, shape, scen, window, causal, *((alibi,) if alibi else ()), *(("sinks",) if sinks else ()))
    kc, vc = f32(rng, N_BLOCKS * BS, n_kv, d), f32(rng, N_BLOCKS * BS, n_kv, d)
    last = {int(s_): int(pos[seq == s_].max()) for s_ in set(seq.tolist())}
    seq_len = np.array([last[int(s_)] + 1 for s_ in seq], np.int32)
    feed = {"q": f32(rng, n, n_head, d), "seq": seq, "pos": pos, "bt": BT,
            "k": f32(rng, len(BT), width, n_kv, d), "v": f32(rng, len(BT), width, n_kv, d),
            "x": f32(rng, n, n_head, width, scale=3), "p": rng.dirichlet(np.ones(width), (n, n_head)).astype(np.float32)}
    if causal == "image":  # each token's horizon: its own position, an image's tokens its last
        seq_len = pos + 1
        seq_len[3:9] = pos[3:9].max(initial=0) + 1
    if causal is not True:
        feed["sl"] = seq_len
    if sinks:  # about the scores' size, some above them all (then most of a row's weight goes nowhere)
        feed["sk"] = f32(rng, n_head, scale=2)
    g = Graph()
    q, sq, ps, bt, k, v, x, p, *rest = inputs(g, **feed)
    sl = rest[0] if causal is not True else None
    causal_mask = causal is not False
    sk = rest[-1] if sinks else None
    kci, vci = g.cache("cache_k", kc.shape, 0), g.cache("cache_v", vc.shape, 0)
    mask = lambda: g.kq_mask(ps, n_kv=width, window=window, seq_len=sl, alibi=alibi, n_head=n_head,  # noqa: E731
                             causal=causal_mask, name="mask")

    def unfused():
        kk = g.gather_kv(kci, bt, block_size=BS, name="k")
        s = g.scale(g.kq(q, kk, sq, "kq"), d ** -0.5, "kq_scaled")
        if softcap:
            s = g.scale(g.tanh(g.scale(s, 1.0 / softcap, "capped_1"), "tanh"), softcap, "capped")
        probs = g.soft_max(g.add(s, mask(), "kq_masked"), "probs", sinks=sk)
        return g.kqv(probs, g.gather_kv(vci, bt, block_size=BS, name="v"), sq, "kqv")
    g.outputs.append({
        "attn": lambda: g.attn(q, kci, vci, sq, ps, bt, scale=d ** -0.5, block_size=BS, window=window,
                               softcap=softcap, alibi=alibi, seq_len=sl, sinks=sk, causal=causal_mask, name="a"),
        "unfused": unfused,
        "gather_kv": lambda: g.gather_kv(kci, bt, block_size=BS, name="k"),
        "kq": lambda: g.kq(q, k, sq, "kq"),
        "kqv": lambda: g.kqv(p, v, sq, "kqv"),
        "kq_mask": mask,
        "attn_temp": lambda: g.mul(q, g.attn_temp(ps, floor=3, beta=0.1, name="temp"), "q_scaled"),
        "soft_max": lambda: g.soft_max(x, "probs"),
        "soft_max_masked": lambda: g.soft_max(g.add(x, mask(), "masked"), "probs", sinks=sk),
    }[part]())
    return g, feed, {"cache_k": kc, "cache_v": vc}


# recurrent batches over N_STATE_SLOTS state slots: (seq_off, state_slot, n_tokens); a row runs
# its tokens [seq_off[i], seq_off[i+1]) from its slot; tokens from seq_off[-1] on are padding
N_STATE_SLOTS = 5
BATCHES = {
    "empty": ([0], [], 0),
    "decode": ([0, 1], [2], 1),
    "uneven": ([0, 1, 6, 6, 9], [3, 1, 0, 4], 12),  # 1, 5, 0 and 3 tokens, then 3 of padding; slot 2 unnamed
    "prefill": ([0, 17], [1], 17),
    "spec": ([0, 1, 5, 8], [3, 1, 0], 9),  # with snapshots: SNAPS
}
# per batch, each token's snapshot slot (-1: none): row 1's verification rows keep the states
# after its tokens 1 and 2 in free slots 2 and 4 (speculative decoding's rollback points)
SNAPS = {"spec": [-1, 2, 4, -1, -1, -1, -1, -1, -1]}


def _snap(feed: dict, batch: str) -> dict:
    """feed, with the batch's snap_slot input where it has snapshots."""
    if batch in SNAPS:
        feed["snap_slot"] = np.asarray(SNAPS[batch], np.int32)
    return feed


def conv_graph(w: QWeight, x, seq_off, state_slot, state, batch=""):
    """One SSM_CONV call: x (n, C) through the conv kernel w (C, K) from the state caches."""
    feed = _snap({"x": x, "seq_off": np.asarray(seq_off, np.int32), "state_slot": np.asarray(state_slot, np.int32)},
                 batch)
    g = Graph()
    xi, oi, si, *snap = inputs(g, **feed)
    g.outputs.append(g.ssm_conv(g.cache("state_conv", state.shape, 0), xi, g.weight(w), oi, si, name="conv",
                                snap_slot=snap[0] if snap else None))
    return g, feed, {"state_conv": state}


def ssm_conv(c, k, batch, qtype=T.F32):
    """LFM2's short convolution (C 1024, K 3) and Mamba-2's (C = d_inner + 2 G N = 3328, K 4)."""
    seq_off, slots, n = BATCHES[batch]
    rng = rng_for("conv", c, k, batch)
    return conv_graph(qweight(qtype, c, k), f32(rng, n, c), seq_off, slots, f32(rng, N_STATE_SLOTS, k - 1, c), batch)


@lru_cache(maxsize=None)
def ssm_a(h: int) -> QWeight:
    """Mamba-2's A = -exp(A_log), one per head: decays of 1 to 16 per unit of dt."""
    a = -np.exp(np.random.default_rng(h).uniform(0, np.log(16), h)).astype(np.float32)
    return QWeight(f"ssm_a-{h}", int(T.F32), (h,), a.reshape(1, -1).view(np.uint8))


def scan_tokens(rng, n, h, p, n_state, n_group):
    """x, dt, B, C of n tokens; softplus(dt) mostly 0.02-2 (dt_bias puts Mamba-2 there), some dt
    above ggml's softplus threshold of 20."""
    dt = f32(rng, n, h, scale=1.5) - 2
    dt[::4, ::7] = 25
    return {"x": f32(rng, n, h, p), "dt": dt, "B": f32(rng, n, n_group, n_state), "C": f32(rng, n, n_group, n_state)}


def scan_graph(h, tokens, seq_off, state_slot, state, a_input=False, batch=""):
    """One SSM_SCAN call; A the (H,) weight, or with a_input an input of shape (1, H)."""
    feed = _snap(dict(tokens, seq_off=np.asarray(seq_off, np.int32), state_slot=np.asarray(state_slot, np.int32)),
                 batch)
    if a_input:
        feed["A"] = dequantize(ssm_a(h)).reshape(1, h)
    g = Graph()
    ins = dict(zip(feed, inputs(g, **feed)))
    a = ins["A"] if a_input else g.weight(ssm_a(h))
    g.outputs.append(g.ssm_scan(g.cache("state_ssm", state.shape, 0), ins["x"], ins["dt"], a, ins["B"], ins["C"],
                                ins["seq_off"], ins["state_slot"], name="scan", snap_slot=ins.get("snap_slot")))
    return g, feed, {"state_ssm": state}


def ssm_scan(h, p, n_state, n_group, batch, a_input=False):
    """Mamba-2's scan: Granite-4.0-H-micro-like (48 heads of 64, d_state 128, 1 group), and 2 groups."""
    seq_off, slots, n = BATCHES[batch]
    rng = rng_for("scan", h, p, n_state, n_group, batch)
    return scan_graph(h, scan_tokens(rng, n, h, p, n_state, n_group), seq_off, slots,
                      f32(rng, N_STATE_SLOTS, h, p, n_state), a_input, batch)


# Gated DeltaNet: (H_k, H_v, d_k, d_v) of Qwen3.5-0.8B, a GQA-like one (H_v = 2 H_k, as Qwen3-Next),
# and a small one with d_k != d_v (a transposed state shows)
DELTA_SHAPES = {"qwen35": (16, 16, 128, 128), "gqa": (16, 32, 128, 128), "small": (2, 4, 32, 16)}
DELTA_BATCHES = {**BATCHES, "decode4": ([0, 1, 2, 3, 4], [4, 0, 3, 1], 4),  # slot 2 unnamed
                 "long": ([0, 150], [3], 150)}  # a prefill across 64-token chunks


def delta_tokens(rng, n, h_k, h_v, d_k, d_v):
    """q, k L2-normalized (as the graph hands them over), beta in (0, 1), g log-decays with
    exp(g) in 0.3..1 and every 5th token hardly decaying (the state remembers)."""
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    gate = np.log(rng.uniform(0.3, 1.0, (n, h_v)))
    gate[::5] = -1e-3
    return {"q": unit(f32(rng, n, h_k, d_k)), "k": unit(f32(rng, n, h_k, d_k)), "v": f32(rng, n, h_v, d_v),
            "gate": gate.astype(np.float32), "beta": (1 / (1 + np.exp(-f32(rng, n, h_v)))).astype(np.float32)}


def delta_graph(tokens, seq_off, state_slot, state, scale, batch=""):
    """One GATED_DELTA_NET call from the state caches (S, H_v, d_v, d_k)."""
    feed = _snap(dict(tokens, seq_off=np.asarray(seq_off, np.int32), state_slot=np.asarray(state_slot, np.int32)),
                 batch)
    g = Graph()
    q, k, v, gate, beta, off, slot, *snap = inputs(g, **feed)
    g.outputs.append(g.gated_delta_net(g.cache("state_dn", state.shape, 0), q, k, v, gate, beta, off, slot,
                                       scale=scale, name="delta_net", snap_slot=snap[0] if snap else None))
    return g, feed, {"state_dn": state}


def delta_net(shape, batch):
    h_k, h_v, d_k, d_v = DELTA_SHAPES[shape]
    seq_off, slots, n = DELTA_BATCHES[batch]
    rng = rng_for("delta", shape, batch)
    return delta_graph(delta_tokens(rng, n, h_k, h_v, d_k, d_v), seq_off, slots,
                       f32(rng, N_STATE_SLOTS, h_v, d_v, d_k, scale=0.5), d_k ** -0.5, batch)


# ---- vision towers ----

def patchify(batch, h, w, p):
    """Patches of B images (rows past a whole patch dropped, as ggml_conv_2d's stride drops them).
    Mutation: flattening each patch (dy, dx, c) instead of (c, dy, dx) fails the cpu/cuda cases
    against a reference that is the conv itself (checked below in test_patchify_is_the_conv)."""
    g = Graph()
    img = f32(rng_for("patch", batch, h, w, p), batch, 3, h, w)
    (x,) = inputs(g, img=img)
    g.outputs.append(g.patchify(x, p, "patches"))
    return g, {"img": img}


def attn_full(n, shape, segs):
    """Attention with no mask, over runs of equal segment ids (images, windows).
    Mutation: letting a token see the next run's keys fails every case with two or more runs."""
    n_head, h_kv, d = shape
    rng = rng_for("attn_full", n, shape, segs)
    q, k, v = f32(rng, n, n_head, d), f32(rng, n, h_kv, d), f32(rng, n, h_kv, d)
    g = Graph()
    srcs = inputs(g, q=q, k=k, v=v)
    feed = dict(q=q, k=k, v=v)
    seg = None
    if segs > 1:
        feed["seg"] = np.sort(rng.integers(0, segs, n)).astype(np.int32)
        seg = g.input("seg", (n,))
    g.outputs.append(g.attn_full(*srcs, scale=1 / math.sqrt(d), seg=seg, name="attn"))
    return g, feed


def pool_2d(batch, ny, nx, k):
    g = Graph()
    a = f32(rng_for("pool", batch, ny, nx, k), batch * ny * nx, 24)
    (x,) = inputs(g, x=a)
    g.outputs.append(g.pool_2d(x, nx=nx, ny=ny, k=k, name="pool"))
    return g, {"x": a}


def case(fn, **kw):
    label = "-".join(v.name if isinstance(v, T) else "x".join(map(str, v)) if isinstance(v, tuple) else f"{k}{v}"
                     for k, v in kw.items())
    return pytest.param(fn, kw, id=f"{fn.__name__}-{label}")


def ks_for(qtype):
    if qtype in IQUANTS:  # one row length each: their kernels are the ones above
        return KQUANT_KS[:1] if qtype in SUPER else KS[2:3]
    return KQUANT_KS if qtype in KQUANTS else KS


CASES = [
    *[case(mul_mat, qtype=t, k=k, n=n) for t in TYPES for k in ks_for(t) for n in TOKENS_MM],
    *[case(mul_mat_add, qtype=t, n=n) for t in BASE_TYPES for n in TOKENS],
    *[case(mul_mat_add, qtype=T.F32, n=n, k=16) for n in (1, 5)],  # a tiny shared expert's down projection
    *[case(ffn_glu, qtype=t, n=n, act=a) for t in BASE_TYPES for n in TOKENS for a in ("silu", "gelu")
      if n != 0 or a == "silu"],
    # the IQ types share the kernels above (i8, nibble, the two lookup layouts): one type of each here
    *[case(f, qtype=t, n=n, **kw) for t in (T.IQ4_XS, T.MXFP4, T.IQ2_XS, T.TQ2_0) for n in (1, 5)
      for f, kw in ((mul_mat_add, {}), (ffn_glu, {"act": "silu"}))],
    case(ffn_glu, qtype=T.Q8_0, n=120, act="silu"),  # n_tokens * n_ff > ffn.WHOLE_MAX: CPU slabs
    *[case(ffn_glu, qtype=T.F32, n=n, act=a, k=16) for n in (1, 5) for a in ("silu", "gelu")],
    *[case(get_rows, qtype=t, n=n) for t in TYPES for n in (0, 1, 17)],
    *[case(get_rows_act, n_out=n) for n in (0, 1, 4)],
    *[case(norm, kind=kind, n=n) for kind in ("rms_norm", "rms_norm_mul", "rms_norm_mul_heads", "rms_norm_mul_add")
      for n in TOKENS],
    case(norm, kind="rms_norm", n=3, k=896),
    *[case(elementwise, kind=kind, n=n) for kind in ("mul", "add", "add_bcast", "add_n3", "add_n4", "scale", "silu",
                                                     "gelu", "tanh", "swiglu", "geglu", "swiglu_oai", "reshape", "slice")
      for n in TOKENS],
    *[case(rope, n=n, head_dim=hd, n_rot=nr, neox=neox, base=base, freq_scale=fs) for n in TOKENS
      for hd, nr, neox, base, fs in [(64, 64, False, 1e4, 1.0), (64, 32, True, 1e4, 0.5), (128, 64, False, 1e4, 1.0),
                                     (128, 128, True, 5e5, 1.0), (256, 256, True, 1e6, 0.125)]],
    *[case(rope_scaled, n=n, neox=neox) for n in TOKENS for neox in (False, True)],
    # M-RoPE: Qwen3.5's partial interleaved (64 of 256), Qwen2-VL's whole head, a tower's 2D (y, x) runs, normal pairs
    *[case(rope_multi, n=n, head_dim=hd, n_rot=nr, neox=neox, n_comp=nc, freqs=f) for n in TOKENS
      for hd, nr, neox, nc, f in [(256, 64, True, 4, False), (128, 128, True, 4, False), (64, 64, True, 2, True),
                                  (64, 32, False, 3, False)]],
    *[case(moe_routing, n=n) for n in TOKENS],
    *[case(lora, n=n) for n in TOKENS],
    *[case(proj_lora, kind=kd, qtype=t, n=n) for kd in ("mm", "add", "ffn", "ffn_up", "stack2", "stack3")
      for t in (T.Q8_0, T.Q4_K, T.F16) for n in TOKENS],
    *[case(proj_lora, kind=kd, qtype=T.Q4_0, n=n, ad=T.F32, mixed=m) for kd in ("mm", "add", "ffn") for n in (1, 5)
      for m in (False, True)],
    *[case(proj_lora, kind=kd, qtype=T.Q8_0, n=1, first=f) for kd in ("mm", "add", "ffn", "ffn_up", "stack3")
      for f in ("both", "none")],
    case(lora, n=5, k=200, rows=4864, ranks=(32,)),  # rank >= 32: B packed "f32"; 200 inputs: lanes and a tail
    *[case(lora, n=n, k=200, rows=4864, ranks=(32, 16), qtype=T.F16) for n in (1, 17)],
    *[case(mul_mat_id, qtype=t, n=n, per_slot=p) for t in (T.F32, T.Q8_0, T.Q5_0, T.Q4_K) for n in (0, 1, 5, 17)
      for p in (False, True)],
    *[case(kv_write, fused=f, n_kv=n_kv, d=d, scen=s) for f in (False, True) for _, n_kv, d in GQA for s in SCENARIOS],
    case(kv_write, fused=True, n_kv=2, d=64, scen="chunk", neox=False),
    *[case(kv_write, fused=True, n_kv=n_kv, d=d, scen=s, mrope=True) for _, n_kv, d in GQA[:2] for s in SCENARIOS],
    *[case(attention, part="attn", shape=sh, scen=s, window=w) for sh in GQA for s in SCENARIOS for w in (0, 8)],
    *[case(attention, part="unfused", shape=sh, scen=s, window=w) for sh in GQA[:2] for s in SCENARIOS for w in (0, 8)],
    # Gemma 2's soft-capped scores (a cap of 1.5 bends the scores of x ~ N(0, 1) keys hard)
    *[case(attention, part=p, shape=GQA[0], scen=s, window=8, softcap=1.5) for p in ("attn", "unfused")
      for s in SCENARIOS],
    *[case(attention, part=p, shape=sh, scen=s, window=0) for p in ("gather_kv", "kq", "kqv", "soft_max")
      for sh in GQA for s in ("empty", "chunk", "prefill")],
    *[case(attention, part=p, shape=GQA[0], scen=s, window=w) for p in ("kq_mask", "soft_max_masked")
      for s in SCENARIOS for w in (0, 8)],
    # encoders: each token over its whole input (a window: llama.cpp's symmetric one, |p - pos| <= 4)
    *[case(attention, part=p, shape=sh, scen=s, window=w, causal=False) for p in ("attn", "unfused", "kq_mask")
      for sh in GQA[:2] for s in ("empty", "encode", "prefill") for w in (0, 8)],
    # ALiBi (jina-bert-v2: max_bias 8, non-causal; 9 heads take both of ggml's slope branches): the cpu's
    # whole-sequence path, and with a window or causal (MPT-style) its flash kernel
    *[case(attention, part=p, shape=sh, scen=s, window=w, causal=False, alibi=8.0) for p in ("attn", "unfused", "kq_mask")
      for sh in GQA[:2] for s in ("empty", "encode", "prefill") for w in (0, 8)],
    *[case(attention, part=p, shape=GQA[0], scen=s, window=0, alibi=8.0) for p in ("attn", "unfused", "kq_mask")
      for s in ("decode", "chunk", "prefill")],
    # an image that attends both ways inside a causal prompt (gemma3's): a horizon per token
    *[case(attention, part=p, shape=sh, scen=s, window=w, causal="image") for p in ("attn", "unfused", "kq_mask")
      for sh in GQA[:2] for s in ("prefill", "chunk") for w in (0, 8)],
    # gpt-oss's sinks: fused (sliding and full layers), unfused, and the softmax alone
    *[case(attention, part=p, shape=sh, scen=s, window=w, sinks=True) for p in ("attn", "unfused", "soft_max_masked")
      for sh in GQA[:2] for s in SCENARIOS for w in (0, 8)],
    # Ministral 3's temperature: positions past the floor (3) scale Q by log(floor(pos / 3) + 1) * 0.1 + 1
    *[case(attention, part="attn_temp", shape=GQA[0], scen=s, window=0) for s in SCENARIOS],
    *[case(elementwise, kind=kind, n=n) for kind in ("sigmoid", "softplus", "l2_norm", "l2_norm_tiny") for n in TOKENS],
    # Gemma 4's clippable linears (gemma4v). Mutation: the cpu's clamp ignoring lo fails these
    *[case(elementwise, kind="clamp", n=n) for n in TOKENS],
    *[case(ssm_conv, c=c, k=k, batch=b) for c, k in ((1024, 3), (3328, 4)) for b in BATCHES],
    case(ssm_conv, c=1024, k=3, batch="uneven", qtype=T.F16),
    *[case(ssm_scan, h=48, p=64, n_state=128, n_group=1, batch=b) for b in BATCHES],
    *[case(ssm_scan, h=32, p=64, n_state=128, n_group=2, batch=b, a_input=True) for b in ("decode", "uneven")],
    *[case(delta_net, shape=s, batch=b) for s in DELTA_SHAPES for b in DELTA_BATCHES],
    *[case(patchify, batch=b, h=h, w=w, p=p) for b, h, w, p in ((1, 8, 8, 4), (2, 12, 20, 4), (1, 30, 17, 7))],
    *[case(attn_full, n=n, shape=sh, segs=sg) for n in (1, 37) for sh in ((4, 4, 16), (6, 2, 32)) for sg in (1, 3)],
    *[case(pool_2d, batch=b, ny=ny, nx=nx, k=k) for b, ny, nx, k in ((1, 8, 8, 4), (2, 4, 6, 2), (1, 6, 6, 4))],
]


def test_patchify_is_the_conv():
    """PATCHIFY times a flattened (n_embd, C, p, p) kernel is a stride-p conv (ggml_conv_2d),
    computed here directly. Mutation: transposing the patch grid (x-major) fails it."""
    rng = rng_for("conv")
    img, ker = f32(rng, 1, 3, 12, 8), f32(rng, 5, 3, 4, 4)
    g, feed = Graph(), {"img": img}
    (x,) = inputs(g, img=img)
    g.outputs.append(g.patchify(x, 4, "patches"))
    got = run_graph(REF, g, feed, {}, "alloc")[0] @ ker.reshape(5, -1).T
    want = np.array([[(img[0, :, y * 4:y * 4 + 4, x * 4:x * 4 + 4] * ker[e]).sum() for e in range(5)]
                     for y in range(3) for x in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attn_full_is_softmax_attention():
    """The reference's ATTN_FULL against softmax(q k^T / sqrt(d)) v written out per run.
    Mutation: a missing scale fails it."""
    g, feed = attn_full(9, (2, 1, 8), 2)
    got = run_graph(REF, g, feed, {}, "alloc")[0].reshape(9, 2, 8)
    q, k, v, seg = feed["q"], feed["k"], feed["v"], feed["seg"]
    for i in range(9):
        same = seg == seg[i]
        for h in range(2):
            s = k[same, 0] @ q[i, h] / math.sqrt(8)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[i, h], (p / p.sum()) @ v[same, 0], rtol=1e-5, atol=1e-6)


def test_rope_multi_semantics():
    """The reference's multi-position RoPE written out: pair i of token t turns by pos[t, comps[i]];
    with every component equal it is plain RoPE; core.array_ops.rope_multi (cuda's, run here on
    numpy) agrees. Mutations: the reference reading component 0 for every pair, or array_ops
    pairing (i, i + 1) under neox, each fail it."""
    g, feed, _ = rope_multi(6, 64, 32, True, 3)
    node = g.outputs[0]
    got = run_graph(REF, g, feed, {}, "alloc")[0]
    x, pos, comps = feed["x"], feed["pos"], node.params["comps"]
    for t in range(6):
        for i in range(16):
            th = pos[t, comps[i]] * 1e4 ** (-2 * i / 32)
            a, b = x[t, :, i], x[t, :, i + 16]
            np.testing.assert_allclose(got[t, :, i], a * np.cos(th) - b * np.sin(th), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got[t, :, i + 16], a * np.sin(th) + b * np.cos(th), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., 32:], x[..., 32:])
    same = np.repeat(feed["pos"][:, :1], 3, axis=1)
    plain, _, _ = rope(6, 64, 32, True, 1e4, 1.0)
    np.testing.assert_allclose(run_graph(REF, g, {"x": x, "pos": same}, {}, "alloc")[0],
                               run_graph(REF, plain, {"x": x, "pos": same[:, 0]}, {}, "alloc")[0], rtol=1e-6)
    for nr, neox, f in ((32, True, False), (32, False, False), (64, True, True)):
        g, feed, _ = rope_multi(5, 64, nr, neox, 2, freqs=f)
        p = g.outputs[0].params
        arr = array_ops.rope_multi(feed["x"], feed["pos"], np, n_rot=p["n_rot"], base=p["base"],
                                   freq_scale=p["freq_scale"], neox=p["neox"], comps=p["comps"], freqs=p.get("freqs"))
        assert nmse(arr, run_graph(REF, g, feed, {}, "alloc")[0]) < 1e-12


@pytest.mark.parametrize("build,kw", CASES)
def test_op(backend, build, kw):
    check(backend, *build(**kw))


# ---- what the cases must cover ----

def test_cases_cover_every_kernel_op_and_weight_type():
    ops, types = set(), set()
    for p in CASES:
        build, kw = p.values
        g = build(**kw)[0]
        ops |= {n.op for n in g.nodes}
        types |= {n.params["weight"].ggml_type for n in g.nodes if n.op is Op.WEIGHT}
    assert set(Op) - NOT_KERNELS <= ops, f"ops without a case: {set(Op) - NOT_KERNELS - ops}"
    assert {int(t) for t in TYPES} <= types


def test_backend_kernels_and_weight_types_are_all_in_the_suite(backend):
    """Every backend runs every op (one backend runs a whole graph), and a weight type a
    backend adds is one this suite must test."""
    assert set(Op) - NOT_KERNELS <= set(backend.kernels), f"no kernel: {set(Op) - NOT_KERNELS - set(backend.kernels)}"
    assert set(backend.weight_types) <= {int(t) for t in TYPES}, "a weight type without cases"


# the slab and tile paths that only big weights or long prefills reach, forced small
SMALL_SLABS = {
    "cpu": [("hearthlm.backends.cpu.ffn", "WHOLE_MAX", 0), ("hearthlm.backends.cpu.matmul", "BLAS_MIN_TOKENS", 16)],
    "cuda": [("hearthlm.backends.cuda.ops", "SLAB_FLOATS", 10 * 1536)],
}


@pytest.mark.parametrize("build,kw", [case(mul_mat, qtype=t, k=1536, n=17) for t in (T.Q8_0, T.Q4_K, T.F16)]
                         + [case(ffn_glu, qtype=t, n=17, act="gelu") for t in (T.Q4_0, T.Q6_K)])
def test_slabs_and_tiles(backend, monkeypatch, build, kw):
    for module, name, value in SMALL_SLABS.get(backend.name, []):
        monkeypatch.setattr(module + "." + name, value)
    check(backend, *build(**kw))


def test_reference_semantics():
    """The oracle itself, against numpy written out by hand: paged reads, GQA heads, windows."""
    seq, pos, _ = scenario("chunk")
    rng = rng_for("ref")
    kc, vc, q = f32(rng, N_BLOCKS * BS, 2, 16), f32(rng, N_BLOCKS * BS, 2, 16), f32(rng, len(seq), 4, 16)
    g = Graph()
    qi, si, pi, bt = inputs(g, q=q, seq=seq, pos=pos, bt=BT)
    kci, vci = g.cache("k", kc.shape, 0), g.cache("v", vc.shape, 0)
    run = lambda node, *srcs: REF.kernels[node.op](node, *srcs)  # noqa: E731
    kn = g.gather_kv(kci, bt, block_size=BS, name="k")
    k = run(kn, kc, BT)
    assert np.array_equal(k[1, 16 + 2], kc[6 * BS + 2])  # position 18 of sequence 1: block 6, offset 2
    s = run(g.kq(qi, kn, si, "kq"), q, k, seq)
    assert np.isclose(s[5, 3, 7], q[5, 3] @ k[1, 7, 1], rtol=1e-5)  # head 3 of 4 reads KV head 1 of 2
    mask = run(g.kq_mask(pi, n_kv=64, window=3, name="m"), pos)
    assert list(np.flatnonzero(mask[4, 0] == 0)) == [22, 23, 24]  # position 24 at window 3
    sl = np.full(len(pos), 30, np.int32)  # non-causal: a 30-token input; llama.cpp's symmetric window
    li = g.input("sl", sl.shape, sl.dtype)
    assert list(np.flatnonzero(run(g.kq_mask(pi, n_kv=64, seq_len=li, name="m"), pos, sl)[4, 0] == 0)) == list(range(30))
    assert list(np.flatnonzero(run(g.kq_mask(pi, n_kv=64, window=8, seq_len=li, name="m"), pos, sl)[4, 0] == 0)) \
        == list(range(20, 29))  # |p - 24| <= 4
    a = run(g.attn(qi, kci, vci, si, pi, bt, scale=0.25, block_size=BS, window=3, name="a"), q, kc, vc, seq, pos, BT)
    slots = BT[0, np.arange(22, 25) // BS] * BS + np.arange(22, 25) % BS
    kk, vv = np.repeat(kc[slots], 2, axis=1), np.repeat(vc[slots], 2, axis=1)  # (3 positions, 4 heads, 16)
    w = np.exp(np.einsum("hd,khd->hk", q[4], kk) * 0.25)
    want = np.einsum("hk,khd->hd", w / w.sum(1, keepdims=True), vv).reshape(-1)
    assert nmse(a[4], want) < 1e-10


def test_reference_alibi():
    """ALiBi as ggml has it, written out: 9 heads, max_bias 8 -> m0 = 2^(-8/8), m1 = 2^(-4/8); heads
    0-7 take m0^(h+1), head 8 m1^1; each score less slope * |p - pos|, in the mask or the fused op."""
    from hearthlm.core.graph import alibi_slopes
    want = [0.5 ** (h + 1) for h in range(8)] + [2 ** -0.5]
    assert np.allclose(alibi_slopes(9, 8.0), want, rtol=1e-6)
    assert np.allclose(alibi_slopes(4, 8.0), [0.25, 0.0625, 0.25 ** 3, 0.25 ** 4], rtol=1e-6)
    seq, pos, _ = scenario("encode")
    rng = rng_for("ref-alibi")
    kc, vc, q = f32(rng, N_BLOCKS * BS, 3, 16), f32(rng, N_BLOCKS * BS, 3, 16), f32(rng, len(seq), 9, 16)
    sl = np.where(seq == 0, 13, 7).astype(np.int32)
    g = Graph()
    qi, si, pi, bt, li = inputs(g, q=q, seq=seq, pos=pos, bt=BT, sl=sl)
    run = lambda node, *srcs: REF.kernels[node.op](node, *srcs)  # noqa: E731
    mask = run(g.kq_mask(pi, n_kv=64, seq_len=li, alibi=8.0, n_head=9, name="m"), pos, sl)
    assert mask.shape == (len(seq), 9, 64) and mask[4, 8, 10] == np.float32(-(2 ** -0.5) * 6)
    assert mask[4, 0, 4] == 0 and np.isneginf(mask[4, 0, 13])  # its own position; past the 13-token input
    a = run(g.attn(qi, g.cache("k", kc.shape, 0), g.cache("v", vc.shape, 0), si, pi, bt, scale=0.25, block_size=BS,
                   alibi=8.0, seq_len=li, name="a"), q, kc, vc, seq, pos, BT, sl)
    t, p = 15, np.arange(7)  # position 2 of the second input (sequence 1: block 1)
    slots = BT[1, p // BS] * BS + p % BS
    kk, vv = np.repeat(kc[slots], 3, axis=1), np.repeat(vc[slots], 3, axis=1)
    s = np.einsum("hd,khd->hk", q[t], kk) * 0.25 - np.array(want)[:, None] * np.abs(p - 2)
    w = np.exp(s - s.max(1, keepdims=True))
    assert nmse(a[t], np.einsum("hk,khd->hd", w / w.sum(1, keepdims=True), vv).reshape(-1)) < 1e-10


def test_reference_sinks():
    """Sinks as ggml has them, written out: each head's sink logit joins the softmax's denominator
    and carries no value; -inf sinks change nothing, and the softmax op says the same as the fused one."""
    seq, pos, _ = scenario("chunk")
    rng = rng_for("ref-sinks")
    kc, vc, q = f32(rng, N_BLOCKS * BS, 2, 16), f32(rng, N_BLOCKS * BS, 2, 16), f32(rng, len(seq), 4, 16)
    sinks = np.array([-np.inf, 0.0, 2.0, 9.0], np.float32)
    g = Graph()
    qi, si, pi, bt, ski = inputs(g, q=q, seq=seq, pos=pos, bt=BT, sk=sinks)
    run = lambda node, *srcs: REF.kernels[node.op](node, *srcs)  # noqa: E731
    a = run(g.attn(qi, g.cache("k", kc.shape, 0), g.cache("v", vc.shape, 0), si, pi, bt, scale=0.25, block_size=BS,
                   sinks=ski, name="a"), q, kc, vc, seq, pos, BT, sinks).reshape(len(seq), 4, 16)
    t = len(seq) - 1
    p = np.arange(pos[t] + 1)
    slots = BT[seq[t], p // BS] * BS + p % BS
    kk, vv = np.repeat(kc[slots], 2, axis=1), np.repeat(vc[slots], 2, axis=1)
    e = np.exp(np.einsum("hd,khd->hk", q[t], kk).astype(np.float64) * 0.25)
    want = np.einsum("hk,khd->hd", e / (e.sum(1, keepdims=True) + np.exp(sinks.astype(np.float64))[:, None]), vv)
    assert nmse(a[t], want) < 1e-10
    assert np.abs(a[t, 3]).max() < 0.05 * np.abs(a[t, 0]).max()  # a sink of 9 takes nearly all the weight
    probs = run(g.soft_max(g.input("x", (1, 4, len(p)), np.float32), "s", sinks=ski),
                (np.einsum("hd,khd->hk", q[t], kk) * 0.25)[None].astype(np.float32), sinks)
    assert np.allclose(probs[0], e / (e.sum(1, keepdims=True) + np.exp(sinks.astype(np.float64))[:, None]), rtol=1e-5)


# ---- recurrent state ----

# two sequences of 7 and 5 tokens; in two calls: 3 tokens of the first and all of the second, then
# the first's other 4 beside an empty row of the second
SPLIT = {"one": ([0, 7, 12], list(range(12))), "first": ([0, 3, 8], [0, 1, 2, 7, 8, 9, 10, 11]),
         "second": ([0, 4, 4], [3, 4, 5, 6])}


@pytest.mark.parametrize("op", ["ssm_conv", "ssm_scan"])
def test_state_carries_across_calls(backend, op):
    """A sequence's tokens split between two calls give the outputs and final state of one call,
    on the reference and on the backend."""
    rng = rng_for("split", op)
    if op == "ssm_conv":
        w, x, state = qweight(T.F32, 1024, 3), f32(rng, 12, 1024), f32(rng, N_STATE_SLOTS, 2, 1024)
        build = lambda rows, seq_off, st: conv_graph(w, x[rows], seq_off, [3, 1], st)  # noqa: E731
    else:
        tokens, state = scan_tokens(rng, 12, 48, 64, 128, 1), f32(rng, N_STATE_SLOTS, 48, 64, 128)
        build = lambda rows, seq_off, st: scan_graph(  # noqa: E731
            48, {k: v[rows] for k, v in tokens.items()}, seq_off, [3, 1], st)
    for be in (REF, backend):
        (off, rows), one = SPLIT["one"], {}
        (y,) = run_graph(be, *build(rows, off, state), "alloc", one)
        ys, st = [], state
        for part in ("first", "second"):
            (off, rows), after = SPLIT[part], {}
            ys.append(run_graph(be, *build(rows, off, st), "alloc", after)[0])
            (st,) = after.values()
        split_y = np.concatenate([ys[0][:3], ys[1], ys[0][3:]])  # back in token order
        assert nmse(split_y, y) < 1e-10 and nmse(st, *one.values()) < 1e-10, be.name


def test_reference_ssm_semantics():
    """The oracle's SSM_CONV and SSM_SCAN against per-token loops written out here: rows of 3 and
    2 tokens, a padding token, 4 heads in 2 groups (ggml's h / (H / G): heads 0, 1 read group 0)."""
    rng = rng_for("ref_ssm")
    seq_off, slots, n = np.array([0, 3, 5], np.int32), np.array([2, 0], np.int32), 6
    run = lambda node, *srcs: REF.kernels[node.op](node, *srcs)  # noqa: E731
    g = Graph()
    off_i, slot_i = inputs(g, seq_off=seq_off, state_slot=slots)

    state, x, w = f32(rng, 3, 2, 3), f32(rng, n, 3), f32(rng, 3, 3)  # 3 slots of K-1 = 2 rows, C = 3
    want_y, want_s = np.zeros((n, 3)), state.astype(np.float64)
    for i in range(2):
        window = list(want_s[slots[i]])  # the last K-1 inputs, oldest first
        for t in range(seq_off[i], seq_off[i + 1]):
            window.append(x[t])
            want_y[t] = [sum(w[ch, k] * window[k][ch] for k in range(3)) for ch in range(3)]
            window.pop(0)
        want_s[slots[i]] = window
    got_s = state.copy()
    (xi,) = inputs(g, x=x)
    got_y = run(g.ssm_conv(g.cache("sc", state.shape, 0), xi, inputs(g, w=w)[0], off_i, slot_i, name="conv"),
                got_s, x, w, seq_off, slots)
    assert nmse(got_y, want_y) < 1e-12 and nmse(got_s, want_s) < 1e-12 and np.array_equal(got_s[1], state[1])

    h, p, d_state, n_group = 4, 2, 3, 2
    state = f32(rng, 3, h, p, d_state)
    t = scan_tokens(rng, n, h, p, d_state, n_group)
    t["dt"][1, 2] = 25.0  # softplus is dt itself above 20
    a = -np.exp(rng.uniform(0, 2, h)).astype(np.float32)
    want_y, want_s = np.zeros((n, h, p)), state.astype(np.float64)
    xs, bs, cs = (t[k].astype(np.float64) for k in ("x", "B", "C"))
    for i in range(2):
        s = want_s[slots[i]]
        for tok in range(seq_off[i], seq_off[i + 1]):
            for hh in range(h):
                grp = hh // (h // n_group)
                d = float(t["dt"][tok, hh])
                sp = d if d > 20 else math.log(1 + math.exp(d))
                for pp in range(p):
                    x_dt = xs[tok, hh, pp] * sp
                    for k in range(d_state):
                        s[hh, pp, k] = s[hh, pp, k] * math.exp(sp * a[hh]) + bs[tok, grp, k] * x_dt
                    want_y[tok, hh, pp] = sum(s[hh, pp, k] * cs[tok, grp, k] for k in range(d_state))
    got_s = state.copy()
    xi, dti, ai, bi, ci = inputs(g, x2=t["x"], dt=t["dt"], a=a, b=t["B"], c=t["C"])
    got_y = run(g.ssm_scan(g.cache("ss", state.shape, 0), xi, dti, ai, bi, ci, off_i, slot_i, name="scan"),
                got_s, t["x"], t["dt"], a, t["B"], t["C"], seq_off, slots)
    assert nmse(got_y, want_y) < 1e-12 and nmse(got_s, want_s) < 1e-12 and np.array_equal(got_s[1], state[1])
    assert not got_y[5].any()  # the padding token


# ---- Gated DeltaNet ----

def _delta_split(shape, n=150):
    """(one call's graph, then the two calls' builders): one sequence of n tokens, slot 3."""
    h_k, h_v, d_k, d_v = DELTA_SHAPES[shape]
    rng = rng_for("delta_split", shape)
    tokens, state = delta_tokens(rng, n, h_k, h_v, d_k, d_v), f32(rng, N_STATE_SLOTS, h_v, d_v, d_k, scale=0.5)
    part = lambda lo, hi, st: delta_graph({k: v[lo:hi] for k, v in tokens.items()}, [0, hi - lo], [3], st,  # noqa: E731
                                          d_k ** -0.5)
    return tokens, state, part


@pytest.mark.parametrize("split", [1, 64, 97])
@pytest.mark.parametrize("shape", ["small", "gqa"])
def test_delta_net_carries_across_calls(backend, shape, split):
    """A 150-token sequence in two calls split at `split` == one call: outputs and final state,
    on the reference and on the backend."""
    _, state, part = _delta_split(shape)
    for be in (REF, backend):
        one, first, second = {}, {}, {}
        (y,) = run_graph(be, *part(0, 150, state), "alloc", one)
        (y1,) = run_graph(be, *part(0, split, state), "alloc", first)
        (y2,) = run_graph(be, *part(split, 150, first["state_dn"]), "alloc", second)
        assert nmse(np.concatenate([y1, y2]), y) < 1e-10, be.name
        assert nmse(second["state_dn"], one["state_dn"]) < 1e-10, be.name


@pytest.mark.parametrize("shape", ["small", "qwen35"])
def test_reference_delta_net_chunked_equals_steps(shape):
    """The oracle's chunked (WY) form == its step form: 150 tokens in one call (two whole chunks
    and a part), and in two calls split inside a chunk and at a chunk's end (state carried)."""
    from hearthlm.backends.reference import gated_delta_net
    tokens, state, _ = _delta_split(shape)
    scale = DELTA_SHAPES[shape][2] ** -0.5
    run = lambda lo, hi, st, chunked: gated_delta_net(  # noqa: E731
        st, *(tokens[k][lo:hi] for k in ("q", "k", "v", "gate", "beta")), np.array([0, hi - lo], np.int32),
        np.array([3], np.int32), scale, chunked=chunked)
    steps = state.copy()
    y = run(0, 150, steps, False)
    for split in (150, 40, 64):
        st = state.copy()
        y_c = np.concatenate([run(0, split, st, True), run(split, 150, st, True)])
        assert nmse(y_c, y) < 1e-12 and nmse(st, steps) < 1e-12, split


def test_reference_delta_net_semantics():
    """The oracle's GATED_DELTA_NET against a per-token loop written out here: rows of 3 and 2
    tokens and a padding token; 4 v-heads over 2 key heads, tiled as ggml (v-head h reads key
    head h % 2, where GQA's h // 2 would differ for heads 1 and 2); d_k 3 != d_v 2."""
    rng = rng_for("ref_delta")
    seq_off, slots, n = np.array([0, 3, 5], np.int32), np.array([2, 0], np.int32), 6
    t, state = delta_tokens(rng, n, 2, 4, 3, 2), f32(rng, 3, 4, 2, 3)
    want_y, want_s = np.zeros((n, 4, 2)), state.astype(np.float64)
    for i in range(2):
        s = want_s[slots[i]]  # (H_v, d_v, d_k), a view
        for tok in range(seq_off[i], seq_off[i + 1]):
            for h in range(4):
                k, q = t["k"][tok, h % 2], t["q"][tok, h % 2] * 0.5
                for j in range(2):
                    s[h, j] *= math.exp(t["gate"][tok, h])
                    delta = (t["v"][tok, h, j] - sum(s[h, j, c] * k[c] for c in range(3))) * t["beta"][tok, h]
                    s[h, j] += delta * k
                    want_y[tok, h, j] = sum(s[h, j, c] * q[c] for c in range(3))
    g, feed, _ = delta_graph(t, seq_off, slots, state, 0.5)
    node, got_s = g.outputs[0], state.copy()
    got_y = REF.kernels[node.op](node, got_s, *(feed[s.name] for s in node.srcs[1:]))
    assert nmse(got_y, want_y) < 1e-12 and nmse(got_s, want_s) < 1e-12 and np.array_equal(got_s[1], state[1])
    assert not got_y[5].any()  # the padding token


def test_rows_argmax_and_top_k_where_the_logits_are(backend):
    """argmax_rows and top_k_rows on logits the backend holds (on cuda, device arrays: cupy's
    argmax and core.array_ops.top_k_rows with cupy) against numpy's argmax and
    sampling.top_k_ids row by row: ties among the k largest, a NaN row, k 1 and 0 rows. The CPU
    kernel's own mutations are in tests/test_top_k_rows.py; here a backend whose override
    returned another row's picks, or unordered ids, fails."""
    from hearthlm.runtime.sampling import top_k_ids
    rng = rng_for("top_k_rows")
    x = (rng.standard_normal((6, 5000)) * 3).astype(np.float32)
    x[1, 100:140] = x[1].max()  # ties at the top, across blocks
    x[2] = np.round(x[2])  # ties everywhere
    x[4, 17] = np.nan
    ks = np.array([40, 30, 7, 1, 40, 0])
    dev = backend.from_host(x)
    assert backend.argmax_rows(dev).tolist() == x.argmax(axis=1).tolist()
    ids, vals, ok = backend.top_k_rows(dev, ks)
    assert ok.tolist()[:5] == [True, True, True, True, False]
    assert ids[3, 0] == x[3].argmax()
    for i in (0, 1, 2):
        want = top_k_ids(x[i], int(ks[i]))
        assert ids[i, :ks[i]].tolist() == want.tolist(), i
        assert np.array_equal(vals[i, :ks[i]], x[i, want]), i
