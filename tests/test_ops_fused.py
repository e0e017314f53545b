"""The ops added with the graph optimizer, numba CPU against the numpy reference (same
thresholds as test_ops.py): the unfused attention parts (gather_kv, kq, kq_mask, soft_max,
kqv), add_n, and the fused ops (rms_norm_mul_add, ffn_glu, mul_mat_add, rope_set_rows)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from test_ops import nmse, qweight, run_both

rng = np.random.default_rng(3)
BS, N_HEAD, N_KV, D = 4, 4, 2, 16
BT = np.array([[5, 2, 7, 0], [1, 6, 3, 0]], np.int32)
SEQ = np.array([0, 0, 0, 1, 1], np.int32)
POS = np.array([5, 6, 7, 0, 9], np.int32)
N_SLOTS = 8 * BS


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def _i(g, name, shape, dt=np.float32):
    return g.input(name, shape, dt)


def test_gather_kv():
    cache = f32(N_SLOTS, N_KV, D)

    def build(g):
        g.outputs.append(g.gather_kv(_i(g, "c", cache.shape), _i(g, "bt", BT.shape, np.int32), block_size=BS, name="k"))
    ref, cpu = run_both(build, {"c": cache, "bt": BT})
    assert ref.shape == (2, 16, N_KV, D) and nmse(cpu, ref) < 1e-7
    assert np.array_equal(ref[1, 4 * 1 + 2], cache[6 * BS + 2])  # block 1 of seq 1 is block 6


def test_kq_and_kqv():
    q, k, v = f32(5, N_HEAD, D), f32(2, 16, N_KV, D), f32(2, 16, N_KV, D)
    probs = rng.random((5, N_HEAD, 16)).astype(np.float32)

    def build_kq(g):
        g.outputs.append(g.kq(_i(g, "q", q.shape), _i(g, "k", k.shape), _i(g, "s", (5,), np.int32), "kq"))

    def build_kqv(g):
        g.outputs.append(g.kqv(_i(g, "p", probs.shape), _i(g, "v", v.shape), _i(g, "s", (5,), np.int32), "kqv"))
    ref, cpu = run_both(build_kq, {"q": q, "k": k, "s": SEQ})
    assert ref.shape == (5, N_HEAD, 16) and nmse(cpu, ref) < 5e-4
    assert np.isclose(ref[3, 3, 7], q[3, 3] @ k[1, 7, 1], rtol=1e-5)  # head 3 reads kv head 1 (GQA 2:1)
    ref, cpu = run_both(build_kqv, {"p": probs, "v": v, "s": SEQ})
    assert ref.shape == (5, N_HEAD, D) and nmse(cpu, ref) < 5e-4


@pytest.mark.parametrize("window", [0, 3])
def test_kq_mask_and_soft_max(window):
    x = f32(5, N_HEAD, 16)

    def build(g):
        m = g.kq_mask(_i(g, "pos", (5,), np.int32), n_kv=16, window=window, name="m")
        g.outputs.append(g.soft_max(g.add(_i(g, "x", x.shape), m, "xm"), "p"))
    ref, cpu = run_both(build, {"x": x, "pos": POS})
    assert nmse(cpu, ref) < 1e-7
    assert np.allclose(ref.sum(-1), 1.0, atol=1e-6)
    seen = ref[0, 0] > 0  # token at position 5
    assert list(np.flatnonzero(seen)) == (list(range(3, 6)) if window == 3 else list(range(6)))


def test_add_n():
    xs = [f32(3, 40) for _ in range(3)]

    def build(g):
        g.outputs.append(g.add_n([_i(g, f"x{i}", (3, 40)) for i in range(3)], "s"))
    ref, cpu = run_both(build, {f"x{i}": x for i, x in enumerate(xs)})
    assert nmse(cpu, ref) < 1e-7 and nmse(ref, xs[0] + xs[1] + xs[2]) < 1e-12


@pytest.mark.parametrize("into", [0, 2])
def test_add_n_into_any_source(into):
    """The planner may give add_n any source's buffer (memory.INPLACE): the sum stays right."""
    from hearthlm.backends.cpu.backend import CPUBackend
    from hearthlm.runtime.graph import Graph, Op
    xs = [f32(3, 40) for _ in range(3)]
    want = xs[0] + xs[1] + xs[2]
    g = Graph()
    node = g.add_n([_i(g, f"x{i}", (3, 40)) for i in range(3)], "s")
    got = CPUBackend().kernels[Op.ADD_N](node, *xs, out=xs[into])
    assert np.allclose(got, want, atol=1e-6)


def test_rms_norm_mul_add():
    x, w, r = f32(5, 96) * 3, f32(96), f32(5, 96)

    def build(g):
        g.outputs.append(g.rms_norm_mul_add(_i(g, "x", x.shape), _i(g, "w", w.shape), _i(g, "r", r.shape), 1e-6, "n"))
    ref, cpu = run_both(build, {"x": x, "w": w, "r": r})
    assert nmse(cpu, ref) < 1e-7


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("n_tokens", [1, 3, 17])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_ffn_glu(qtype, n_tokens, act):
    """n_ff = 600: more than one slab (ffn.CHUNK), the last one partial."""
    wg, wu = qweight("g", rng.standard_normal((600, 128)), qtype), qweight("u", rng.standard_normal((600, 128)), qtype)
    x = f32(n_tokens, 128) * 0.3

    def build(g):
        g.outputs.append(g.ffn_glu(g.weight(wg), g.weight(wu), _i(g, "x", x.shape), act, "f"))
    ref, cpu = run_both(build, {"x": x})
    assert ref.shape == (n_tokens, 600) and nmse(cpu, ref) < 5e-4


@pytest.mark.parametrize("n_tokens", [1, 17])
def test_mul_mat_add(n_tokens):
    w, x, r = qweight("w", rng.standard_normal((67, 128)), T.Q8_0), f32(n_tokens, 128), f32(n_tokens, 67)

    def build(g):
        g.outputs.append(g.mul_mat_add(g.weight(w), _i(g, "x", x.shape), _i(g, "r", r.shape), "y"))
    ref, cpu = run_both(build, {"x": x, "r": r})
    assert nmse(cpu, ref) < 5e-4


@pytest.mark.parametrize("neox", [False, True])
def test_rope_set_rows(neox):
    cache = f32(N_SLOTS, N_KV, D)
    x = f32(5, N_KV, D)
    slots = np.array([BT[s, p // BS] * BS + p % BS for s, p in zip(SEQ, POS)], np.int32)

    def build(g):
        c = g.rope_set_rows(g.cache("cache_k", cache.shape, 0), _i(g, "x", x.shape), _i(g, "pos", (5,), np.int32),
                            _i(g, "slots", (5,), np.int32), name="kw", n_rot=D, base=10000.0, freq_scale=1.0, neox=neox)
        g.outputs.append(g.gather_kv(c, _i(g, "bt", BT.shape, np.int32), block_size=BS, name="k"))
    ref, cpu = run_both(build, {"x": x, "pos": POS, "slots": slots, "bt": BT}, {"cache_k": cache})
    assert nmse(cpu, ref) < 1e-7
    assert not np.allclose(ref[0, 6], x[1])  # position 6 of seq 0 holds the rotated x[1]
