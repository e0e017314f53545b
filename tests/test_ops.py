"""Every op of the numba CPU backend against the numpy reference (llama.cpp's
test-backend-ops thresholds: NMSE < 5e-4 for mul_mat and attention, 1e-7 elsewhere)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.backends.reference import ReferenceBackend
from hearthlm.runtime.dispatch import WeightStore, execute
from hearthlm.runtime.graph import Graph
from hearthlm.runtime.weights import QWeight

rng = np.random.default_rng(0)


def nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def qweight(name, data: np.ndarray, qtype: T) -> QWeight:
    raw = data.astype(np.float32) if qtype == T.F32 else quants.quantize(data.astype(np.float32), qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(data.shape[0] if data.ndim == 2 else 1, -1)
    return QWeight(name, int(qtype), data.shape, raw)


def run_both(build, feed, caches=None):
    """Build the graph twice (the builders are pure) and run it on both backends."""
    outs = []
    for be in (ReferenceBackend(), CPUBackend()):
        g = Graph()
        build(g)
        local = {k: v.copy() for k, v in (caches or {}).items()}
        outs.append(execute(g, WeightStore(be), feed, lambda n: local[n.name])[0])
    return outs


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("n_tokens", [1, 3, 17])
def test_mul_mat(qtype, n_tokens):
    w = qweight("w", rng.standard_normal((67, 128)), qtype)
    x = rng.standard_normal((n_tokens, 128)).astype(np.float32)

    def build(g):
        g.outputs.append(g.mul_mat(g.weight(w), g.input("x", x.shape, np.float32), "y"))
    ref, cpu = run_both(build, {"x": x})
    assert nmse(cpu, ref) < 5e-4


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_1, T.Q8_0])
def test_get_rows_weight(qtype):
    w = qweight("emb", rng.standard_normal((50, 64)), qtype)
    ids = np.array([0, 49, 7, 7], np.int32)

    def build(g):
        g.outputs.append(g.get_rows(g.weight(w), g.input("ids", (4,)), "rows"))
    ref, cpu = run_both(build, {"ids": ids})
    assert nmse(cpu, ref) < 1e-7


def _unary(kind):
    def build(g):
        x = g.input("x", (5, 96), np.float32)
        w = g.input("w", (96,), np.float32)
        g.outputs.append({
            "rms_norm": lambda: g.rms_norm(x, 1e-5, "n"),
            "rms_norm_mul": lambda: g.rms_norm_mul(x, w, 1e-5, "n"),
            "mul": lambda: g.mul(x, w, "m"),
            "add": lambda: g.add(x, x, "a"),
            "scale": lambda: g.scale(x, 0.3, "s"),
            "silu": lambda: g.silu(x, "s"),
            "gelu": lambda: g.gelu(x, "s"),
            "tanh": lambda: g.tanh(x, "t"),
            "swiglu": lambda: g.glu(x, x, "silu", "s"),
            "geglu": lambda: g.glu(x, g.scale(x, 2.0, "x2"), "gelu", "s"),
            "reshape": lambda: g.reshape(x, (5, 3, 32), "r"),
        }[kind]())
    return build


@pytest.mark.parametrize("kind", ["rms_norm", "rms_norm_mul", "mul", "add", "scale", "silu", "gelu", "tanh",
                                  "swiglu", "geglu", "reshape"])
def test_elementwise_and_norm(kind):
    feed = {"x": rng.standard_normal((5, 96)).astype(np.float32) * 3,
            "w": rng.standard_normal(96).astype(np.float32)}
    ref, cpu = run_both(_unary(kind), feed)
    assert cpu.shape == ref.shape
    assert nmse(cpu, ref) < 1e-7


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(neox, n_rot):
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 5000, 7], np.int32)

    def build(g):
        g.outputs.append(g.rope(g.input("x", x.shape, np.float32), g.input("pos", (6,)), n_rot=n_rot,
                                base=10000.0, freq_scale=0.5, neox=neox, name="r"))
    ref, cpu = run_both(build, {"x": x, "pos": pos})
    assert nmse(cpu, ref) < 1e-7
    assert not np.allclose(cpu[3], x[3])  # it rotated something


@pytest.mark.parametrize("neox", [False, True])
def test_rope_scaled(neox):
    """Scaled RoPE: per-dimension frequencies and a cos/sin magnitude (YaRN, Llama 3, LongRoPE)."""
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 5000, 7], np.int32)
    freqs = tuple(10000.0 ** (-np.arange(16) / 16) / np.linspace(1, 8, 16))

    def build(g):
        g.outputs.append(g.rope(g.input("x", x.shape, np.float32), g.input("pos", (6,)), n_rot=32, base=10000.0,
                                neox=neox, name="r", freqs=freqs, mscale=1.2))
    ref, cpu = run_both(build, {"x": x, "pos": pos})
    assert nmse(cpu, ref) < 1e-7
    # position 0 only scales by mscale; rotated dims grow, the rest copy
    assert np.allclose(ref[0, :, :32], 1.2 * x[0, :, :32], atol=1e-6) and np.array_equal(ref[0, :, 32:], x[0, :, 32:])


@pytest.mark.parametrize("window", [0, 3])
def test_kv_write_and_attention_paged(window):
    """Two sequences with scattered blocks, GQA 4:2, a prefill chunk and a decode token."""
    bs, n_head, n_kv, d = 4, 4, 2, 16
    n_slots = 8 * bs
    cache = rng.standard_normal((n_slots, n_kv, d)).astype(np.float32)  # stale data must be ignored
    block_table = np.array([[5, 2, 7, 0], [1, 6, 0, 0]], np.int32)
    tok_seq = np.array([0, 0, 0, 0, 0, 0, 1], np.int32)
    tok_pos = np.array([4, 5, 6, 7, 8, 9, 6], np.int32)
    slots = np.array([block_table[s, p // bs] * bs + p % bs for s, p in zip(tok_seq, tok_pos)], np.int32)
    n = len(tok_seq)
    feed = {"q": rng.standard_normal((n, n_head, d)).astype(np.float32),
            "k": rng.standard_normal((n, n_kv, d)).astype(np.float32),
            "v": rng.standard_normal((n, n_kv, d)).astype(np.float32),
            "seq": tok_seq, "pos": tok_pos, "bt": block_table, "slots": slots}

    def build(g):
        i = lambda name, shape, dt=np.int32: g.input(name, shape, dt)  # noqa: E731
        kc = g.set_rows(g.cache("cache_k", cache.shape, 0), i("k", (n, n_kv, d), np.float32), i("slots", (n,)), "kw")
        vc = g.set_rows(g.cache("cache_v", cache.shape, 0), i("v", (n, n_kv, d), np.float32), i("slots", (n,)), "vw")
        g.outputs.append(g.attn(i("q", (n, n_head, d), np.float32), kc, vc, i("seq", (n,)), i("pos", (n,)),
                                i("bt", block_table.shape), scale=0.25, block_size=bs, window=window, name="a"))
    ref, cpu = run_both(build, feed, {"cache_k": cache, "cache_v": cache * 0.5})
    assert ref.shape == (n, n_head * d)
    assert nmse(cpu, ref) < 5e-4
    # the attention of the last token of sequence 0 at window 3 sees exactly its own 3 newest positions
    if window == 3:
        qv, k, v = feed["q"][5], feed["k"][3:6], feed["v"][3:6]
        s = np.einsum("hd,khd->hk", qv, np.repeat(k, 2, axis=1)) * 0.25
        p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
        want = np.einsum("hk,khd->hd", p, np.repeat(v, 2, axis=1)).reshape(-1)
        assert nmse(ref[5], want) < 1e-10


def test_moe_routing_ops():
    """top_k (largest first), take, sum_rows and div: the router's part of a MoE FFN."""
    x = rng.standard_normal((7, 16)).astype(np.float32)

    def build(g):
        xi = g.input("x", x.shape, np.float32)
        ids = g.top_k(xi, 3, "ids")
        w = g.take(xi, ids, "w")
        g.outputs += [ids, g.div(w, g.sum_rows(w, "s"), "wn")]
    outs = []
    for be in (ReferenceBackend(), CPUBackend()):
        g = Graph()
        build(g)
        outs.append(execute(g, WeightStore(be), {"x": x}, None))
    (ref_ids, ref_w), (cpu_ids, cpu_w) = outs
    assert np.array_equal(ref_ids, cpu_ids) and np.array_equal(ref_ids, np.argsort(-x, axis=1)[:, :3])
    assert nmse(cpu_w, ref_w) < 1e-7 and np.allclose(ref_w.sum(1), 1.0)


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q5_0])
@pytest.mark.parametrize("per_slot", [False, True])
def test_mul_mat_id(qtype, per_slot):
    """Expert matmul: x (n, cols) or (n, k, cols) through the experts ids selects."""
    n_exp, rows, cols, n, k = 6, 24, 256, 5, 2
    w = rng.standard_normal((n_exp, rows, cols)).astype(np.float32)
    raw = w.reshape(n_exp * rows, cols)
    qw = qweight("exps", raw, qtype)
    qw = QWeight("exps", qw.ggml_type, (n_exp, rows, cols), qw.raw)
    x = rng.standard_normal((n, k, cols) if per_slot else (n, cols)).astype(np.float32)
    ids = np.array([[0, 3], [3, 5], [5, 0], [3, 0], [5, 3]], np.int32)  # experts 1, 2, 4 unused

    def build(g):
        g.outputs.append(g.mul_mat_id(g.weight(qw), g.input("x", x.shape, np.float32), g.input("ids", ids.shape),
                                      "y"))
    ref, cpu = run_both(build, {"x": x, "ids": ids})
    assert ref.shape == (n, k, rows) and nmse(cpu, ref) < 5e-4
    xs = x if per_slot else np.repeat(x[:, None], k, axis=1)
    assert nmse(ref, np.einsum("tkc,tkrc->tkr", xs, w[ids])) < (1e-10 if qtype == T.F32 else 5e-3)


def test_mul_mat_id_reads_only_selected_experts():
    from hearthlm.backends.cpu.backend import Experts
    from hearthlm.backends.cpu.qtypes import pack_weight
    w = rng.standard_normal((3, 8, 32)).astype(np.float32)
    used = {e: pack_weight(int(T.F32), w[e].view(np.uint8), (8, 32)) for e in (0, 2)}
    experts = Experts(used.get(e) for e in range(3))  # expert 1 absent: reading it would fail
    g = Graph()
    node = g.mul_mat_id(g.weight(QWeight("e", int(T.F32), (3, 8, 32), np.zeros((24, 128), np.uint8))),
                        g.input("x", (2, 32), np.float32), g.input("ids", (2, 1)), "y")
    x, ids = rng.standard_normal((2, 32)).astype(np.float32), np.array([[2], [0]], np.int32)
    y = CPUBackend().kernels[node.op](node, experts, x, ids)
    assert np.allclose(y[:, 0], np.stack([x[0] @ w[2].T, x[1] @ w[0].T]), atol=1e-4)
