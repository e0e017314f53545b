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
