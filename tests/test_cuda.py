"""The cuda backend. Without a GPU: every .cu file compiles with nvcc for sm_90 (as NVRTC
will see it, headers inlined); the block unpacking of quants.cuh, compiled as plain C++,
matches gguf's dequantization exactly; the package imports without CuPy and says what is
missing. With CuPy and a device (`-m gpu`): every op and weight type against the numpy
reference, at test_ops.py's thresholds (NMSE < 5e-4 for products and attention, 1e-7
elsewhere)."""
import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.cuda.modules import CU_FILES, KERNEL_DIR, source
from hearthlm.backends.reference import ReferenceBackend
from hearthlm.runtime.dispatch import WeightStore, execute
from hearthlm.runtime.errors import BackendError
from hearthlm.runtime.graph import Graph
from hearthlm.runtime.weights import QWeight

QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
QTYPES = QUANTIZABLE + KQUANTS
KQUANT_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def make_raw(qtype, n_rows, n_cols, rng):
    """Raw GGUF bytes (n_rows, row_bytes): quantized normals, or random K-quant blocks with sane scales
    (gguf cannot quantize K-quants)."""
    if qtype in KQUANTS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n_rows * n_cols // block, size), dtype=np.uint8)
        for off in KQUANT_F16_FIELDS[qtype]:
            raw[:, off:off + 2] = rng.uniform(0.001, 0.02, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        w = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        raw = w.view(np.uint8) if qtype == T.F32 else quants.quantize(w, qtype).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(n_rows, -1))


def qweight(name, qtype, n_rows, n_cols, rng) -> QWeight:
    return QWeight(name, int(qtype), (n_rows, n_cols), make_raw(qtype, n_rows, n_cols, rng))


# ---- without a GPU ----

def test_kernels_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found (install the CUDA toolkit to compile-check the kernels)")
    names = []
    for f in CU_FILES:  # as NVRTC compiles them: one string each, local headers inlined
        (tmp_path / f).write_text(source(f))
        names.append(f)
    assert sorted(CU_FILES) == sorted(p.name for p in KERNEL_DIR.glob("*.cu")), "a .cu file is not in CU_FILES"
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", "--Werror", "all-warnings", *names],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for f in names:
        assert (tmp_path / f.replace(".cu", ".o")).stat().st_size > 0


_HARNESS = r"""
#include "quants.cuh"
#define ALL(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K)
template <int T> void deq(const u8* raw, long rb, int nr, int nc, float* out) {
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc / 32; ++c) {
            Chunk k; unpack<T>(raw + r * rb, c, k);
            for (int i = 0; i < 32; ++i) out[(long)r * nc + 32 * c + i] = chunk_weight(k, i);
        }
}
template <int T> void dot(const u8* raw, long rb, int nr, int nc, const int* xq, const float* xd,
                          const float* xs, float* y) {
    for (int r = 0; r < nr; ++r) {
        float acc = 0;
        for (int c = 0; c < nc / 32; ++c) {
            Chunk k; unpack<T>(raw + r * rb, c, k);
            acc += chunk_dot(k, xq + 8 * c, xd[c], xs + 2 * c);
        }
        y[r] = acc;
    }
}
extern "C" int host_dequant(int t, const u8* raw, long rb, int nr, int nc, float* out) {
#define C(T) if (t == T) { deq<T>(raw, rb, nr, nc, out); return 0; }
    ALL(C) return 1;
#undef C
}
extern "C" int host_dot(int t, const u8* raw, long rb, int nr, int nc, const int* xq, const float* xd,
                        const float* xs, float* y) {
#define C(T) if (t == T) { dot<T>(raw, rb, nr, nc, xq, xd, xs, y); return 0; }
    ALL(C) return 1;
}
extern "C" float host_h2f(u16 h) { return h2f(h); }
"""


@pytest.fixture(scope="module")
def host_quants(tmp_path_factory):
    """quants.cuh (the GPU's block unpacking and dot products) built as a host library."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build quants.cuh for the host")
    d = tmp_path_factory.mktemp("host_quants")
    (d / "h.cpp").write_text(_HARNESS)
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{KERNEL_DIR}",
                        "h.cpp", "-o", "h.so"], cwd=d, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    lib = ctypes.CDLL(str(d / "h.so"))
    lib.host_h2f.restype, lib.host_h2f.argtypes = ctypes.c_float, [ctypes.c_uint16]
    return lib


def q8_1(x):
    """Activations as matmul.cu's quantize_q8 makes them: int8 per 32, the scale, float sums per 16."""
    xb = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(xb).max(1) / 127
    q = np.rint(xb / np.where(d > 0, d, 1)[:, None]).astype(np.int8)
    return np.ascontiguousarray(q), np.ascontiguousarray(d, np.float32), xb.reshape(-1, 2, 16).sum(-1).astype(np.float32)


def test_half_to_float_on_host(host_quants):
    bits = np.arange(1 << 16, dtype=np.uint16)
    ours = np.array([host_quants.host_h2f(int(b)) for b in bits], np.float32)
    want = bits.view(np.float16).astype(np.float32)
    assert np.all((ours.view(np.uint32) == want.view(np.uint32)) | (np.isnan(ours) & np.isnan(want)))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_unpack_and_dot_on_host(host_quants, qtype):
    rng = np.random.default_rng(int(qtype))
    n_rows, n_cols = 9, 512
    raw = make_raw(qtype, n_rows, n_cols, rng)
    want = quants.dequantize(raw, qtype).reshape(n_rows, n_cols).astype(np.float32)
    out = np.zeros((n_rows, n_cols), np.float32)
    P = ctypes.c_void_p
    assert host_quants.host_dequant(int(qtype), raw.ctypes.data_as(P), ctypes.c_long(raw.shape[1]), n_rows, n_cols,
                                    out.ctypes.data_as(P)) == 0
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    x = rng.standard_normal(n_cols).astype(np.float32)
    xq, xd, xs = q8_1(x)
    y = np.zeros(n_rows, np.float32)
    host_quants.host_dot(int(qtype), raw.ctypes.data_as(P), ctypes.c_long(raw.shape[1]), n_rows, n_cols,
                         xq.ctypes.data_as(P), xd.ctypes.data_as(P), xs.ctypes.data_as(P), y.ctypes.data_as(P))
    assert nmse(y, want.astype(np.float64) @ x) < 5e-4


def test_imports_without_cupy_and_says_what_is_missing(monkeypatch):
    from hearthlm.backends.cuda import backend
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    with pytest.raises(BackendError, match=r"hearthlm\[gpu\]"):
        backend.CUDABackend()


def test_no_device_is_a_backend_error():
    from hearthlm.backends.cuda.backend import CUDABackend
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present")
    except ImportError:
        pass
    except Exception:  # CUDARuntimeError: no driver or device, which is what this test wants
        pass
    with pytest.raises(BackendError, match=r"hearthlm\[gpu\]|no CUDA device"):
        CUDABackend()


# ---- on a GPU ----

def _gpu_or_skip():
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy is not installed (pip install 'hearthlm[gpu]')")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception as e:
        pytest.skip(f"no CUDA device ({e})")


@pytest.fixture(scope="module")
def cuda():
    _gpu_or_skip()
    from hearthlm.backends.cuda.backend import CUDABackend
    return CUDABackend()


def run_both(cuda, build, feed, caches=None):
    """Build the graph twice (builders are pure); run it on the reference and on the GPU."""
    outs = []
    for be in (ReferenceBackend(), cuda):
        g = Graph()
        build(g)
        local = {k: be.from_host(v.copy()) for k, v in (caches or {}).items()}
        outs.append(execute(g, WeightStore(be), {k: be.from_host(v) for k, v in feed.items()},
                            lambda n: local[n.name])[0])
    return outs


rng = np.random.default_rng(7)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def _in(g, name, shape, dt=np.float32):
    return g.input(name, shape, dt)


FLOATS = [T.F32, T.F16, T.BF16]


def float_weight(name, qtype, n_rows, n_cols):
    w = f32(n_rows, n_cols)
    raw = w if qtype == T.F32 else quants.quantize(w, qtype)
    return QWeight(name, int(qtype), (n_rows, n_cols), np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1))


def any_weight(name, qtype, n_rows, n_cols):
    return float_weight(name, qtype, n_rows, n_cols) if qtype in FLOATS else qweight(name, qtype, n_rows, n_cols, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", FLOATS + QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 3, 8, 17])  # mmvq up to 8 tokens, dequantize + cuBLAS above
def test_mul_mat(cuda, qtype, n_tokens):
    w = any_weight("w", qtype, 67, 512)
    x = f32(n_tokens, 512)

    def build(g):
        g.outputs.append(g.mul_mat(g.weight(w), _in(g, "x", x.shape), "y"))
    ref, gpu = run_both(cuda, build, {"x": x})
    assert gpu.shape == ref.shape and nmse(gpu, ref) < 5e-4


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", FLOATS + QTYPES, ids=lambda t: t.name)
def test_get_rows_weight(cuda, qtype):
    w = any_weight("emb", qtype, 50, 256)
    ids = np.array([0, 49, 7, 7], np.int32)

    def build(g):
        g.outputs.append(g.get_rows(g.weight(w), g.input("ids", (4,)), "rows"))
    ref, gpu = run_both(cuda, build, {"ids": ids})
    assert nmse(gpu, ref) < 1e-7


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.F32, T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 5, 17])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_ffn_glu(cuda, qtype, n_tokens, act):
    wg, wu = any_weight("g", qtype, 600, 256), any_weight("u", qtype, 600, 256)
    x = f32(n_tokens, 256) * (0.003 if qtype in KQUANTS else 0.3)  # random K-quant blocks make big weights

    def build(g):
        g.outputs.append(g.ffn_glu(g.weight(wg), g.weight(wu), _in(g, "x", x.shape), act, "f"))
    ref, gpu = run_both(cuda, build, {"x": x})
    assert gpu.shape == (n_tokens, 600) and nmse(gpu, ref) < 5e-4


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 17])
def test_mul_mat_add(cuda, qtype, n_tokens):
    w, x, r = any_weight("w", qtype, 67, 256), f32(n_tokens, 256), f32(n_tokens, 67)

    def build(g):
        g.outputs.append(g.mul_mat_add(g.weight(w), _in(g, "x", x.shape), _in(g, "r", r.shape), "y"))
    ref, gpu = run_both(cuda, build, {"x": x, "r": r})
    assert nmse(gpu, ref) < 5e-4


def _unary(kind):
    def build(g):
        x, w = _in(g, "x", (5, 96)), _in(g, "w", (96,))
        r = _in(g, "r", (5, 96))
        g.outputs.append({
            "rms_norm": lambda: g.rms_norm(x, 1e-5, "n"),
            "rms_norm_mul": lambda: g.rms_norm_mul(x, w, 1e-5, "n"),
            "rms_norm_mul_add": lambda: g.rms_norm_mul_add(x, w, r, 1e-6, "n"),
            "rms_norm_heads": lambda: g.rms_norm_mul(g.reshape(x, (5, 3, 32), "xh"), _in(g, "w32", (32,)), 1e-6, "n"),
            "mul": lambda: g.mul(x, w, "m"),
            "add": lambda: g.add(x, x, "a"),
            "add_n": lambda: g.add_n([x, r, x], "a"),
            "scale": lambda: g.scale(x, 0.3, "s"),
            "silu": lambda: g.silu(x, "s"),
            "gelu": lambda: g.gelu(x, "s"),
            "tanh": lambda: g.tanh(x, "t"),
            "swiglu": lambda: g.glu(x, r, "silu", "s"),
            "geglu": lambda: g.glu(x, g.scale(x, 2.0, "x2"), "gelu", "s"),
            "reshape": lambda: g.reshape(x, (5, 3, 32), "r"),
        }[kind]())
    return build


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms_norm", "rms_norm_mul", "rms_norm_mul_add", "rms_norm_heads", "mul", "add",
                                  "add_n", "scale", "silu", "gelu", "tanh", "swiglu", "geglu", "reshape"])
def test_elementwise_and_norm(cuda, kind):
    # float32 expf/tanhf on the GPU vs numpy's differ by an ulp or two: NMSE ~1e-14, far under 1e-7
    feed = {"x": f32(5, 96) * 3, "w": f32(96), "r": f32(5, 96), "w32": f32(32)}
    ref, gpu = run_both(cuda, _unary(kind), feed)
    assert gpu.shape == ref.shape and nmse(gpu, ref) < 1e-7


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(cuda, neox, n_rot):
    x = f32(6, 4, 64)
    pos = np.array([0, 1, 2, 100, 5000, 7], np.int32)

    def build(g):
        g.outputs.append(g.rope(_in(g, "x", x.shape), g.input("pos", (6,)), n_rot=n_rot, base=10000.0,
                                freq_scale=0.5, neox=neox, name="r"))
    ref, gpu = run_both(cuda, build, {"x": x, "pos": pos})
    assert nmse(gpu, ref) < 1e-7
    assert not np.allclose(gpu[3], x[3])


@pytest.mark.gpu
def test_rope_scaled(cuda):
    x = f32(6, 4, 64)
    pos = np.array([0, 1, 2, 100, 5000, 7], np.int32)
    freqs = tuple(10000.0 ** (-np.arange(16) / 16) / np.linspace(1, 8, 16))

    def build(g):
        g.outputs.append(g.rope(_in(g, "x", x.shape), g.input("pos", (6,)), n_rot=32, base=10000.0, neox=True,
                                name="r", freqs=freqs, mscale=1.2))
    ref, gpu = run_both(cuda, build, {"x": x, "pos": pos})
    assert nmse(gpu, ref) < 1e-7


BS, N_SLOTS = 4, 32
BT = np.array([[5, 2, 7, 0], [1, 6, 3, 0]], np.int32)
SEQ = np.array([0, 0, 0, 0, 0, 0, 1], np.int32)
POS = np.array([4, 5, 6, 7, 8, 9, 6], np.int32)
SLOTS = np.array([BT[s, p // BS] * BS + p % BS for s, p in zip(SEQ, POS)], np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("n_head,n_kv,d", [(4, 2, 16), (8, 1, 256), (9, 3, 64)])
def test_kv_write_and_attention_paged(cuda, window, n_head, n_kv, d):
    """Scattered blocks, GQA, a prefill chunk and a decode token, stale cache data to ignore."""
    n = len(SEQ)
    cache = f32(N_SLOTS, n_kv, d)
    feed = {"q": f32(n, n_head, d), "k": f32(n, n_kv, d), "v": f32(n, n_kv, d), "seq": SEQ, "pos": POS,
            "bt": BT, "slots": SLOTS}

    def build(g):
        i = lambda name, shape, dt=np.int32: g.input(name, shape, dt)  # noqa: E731
        kc = g.set_rows(g.cache("cache_k", cache.shape, 0), i("k", (n, n_kv, d), np.float32), i("slots", (n,)), "kw")
        vc = g.set_rows(g.cache("cache_v", cache.shape, 0), i("v", (n, n_kv, d), np.float32), i("slots", (n,)), "vw")
        g.outputs.append(g.attn(i("q", (n, n_head, d), np.float32), kc, vc, i("seq", (n,)), i("pos", (n,)),
                                i("bt", BT.shape), scale=d ** -0.5, block_size=BS, window=window, name="a"))
    ref, gpu = run_both(cuda, build, feed, {"cache_k": cache, "cache_v": cache * 0.5})
    assert gpu.shape == (n, n_head * d) and nmse(gpu, ref) < 5e-4


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [False, True])
def test_rope_set_rows(cuda, neox):
    cache, x = f32(N_SLOTS, 2, 16), f32(len(SEQ), 2, 16)

    def build(g):
        c = g.rope_set_rows(g.cache("cache_k", cache.shape, 0), _in(g, "x", x.shape), _in(g, "pos", (7,), np.int32),
                            _in(g, "slots", (7,), np.int32), name="kw", n_rot=16, base=10000.0, freq_scale=1.0,
                            neox=neox)
        g.outputs.append(g.gather_kv(c, _in(g, "bt", BT.shape, np.int32), block_size=BS, name="k"))
    ref, gpu = run_both(cuda, build, {"x": x, "pos": POS, "slots": SLOTS, "bt": BT}, {"cache_k": cache})
    assert nmse(gpu, ref) < 1e-7


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 3])
def test_unfused_attention_parts(cuda, window):
    """gather_kv -> kq -> kq_mask + soft_max -> kqv, as the builders emit them before fusion."""
    n, n_head, n_kv, d = len(SEQ), 4, 2, 16
    kc, vc = f32(N_SLOTS, n_kv, d), f32(N_SLOTS, n_kv, d)
    feed = {"q": f32(n, n_head, d), "seq": SEQ, "pos": POS, "bt": BT, "kc": kc, "vc": vc}

    def build(g):
        seq = _in(g, "seq", (n,), np.int32)
        k = g.gather_kv(_in(g, "kc", kc.shape), _in(g, "bt", BT.shape, np.int32), block_size=BS, name="k")
        v = g.gather_kv(_in(g, "vc", vc.shape), g.inputs["bt"], block_size=BS, name="v")
        s = g.scale(g.kq(_in(g, "q", (n, n_head, d)), k, seq, "kq"), 0.25, "kqs")
        m = g.kq_mask(_in(g, "pos", (n,), np.int32), n_kv=k.shape[1], window=window, name="m")
        g.outputs.append(g.kqv(g.soft_max(g.add(s, m, "kqm"), "p"), v, seq, "o"))
    ref, gpu = run_both(cuda, build, feed)
    assert nmse(gpu, ref) < 5e-4


@pytest.mark.gpu
def test_big_weight_goes_through_slabs(cuda, monkeypatch):
    """A dequantize + cuBLAS product wider than one scratch slab (ops.SLAB_FLOATS)."""
    from hearthlm.backends.cuda import ops
    monkeypatch.setattr(ops, "SLAB_FLOATS", 256 * 10)
    w, x = qweight("w", T.Q4_K, 67, 256, rng), f32(12, 256)

    def build(g):
        g.outputs.append(g.mul_mat(g.weight(w), _in(g, "x", x.shape), "y"))
    ref, gpu = run_both(cuda, build, {"x": x})
    assert nmse(gpu, ref) < 5e-4


@pytest.mark.gpu
@pytest.mark.parametrize("per_slot", [False, True])
def test_moe_ops(cuda, per_slot):
    """The router's ops and the expert matmul (Q8_0 experts) against the reference."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from hearthlm.runtime.weights import QWeight
    n_exp, rows, cols, n, k = 6, 24, 256, 5, 2
    raw = quants.quantize(np.random.default_rng(1).standard_normal((n_exp * rows, cols)).astype(np.float32), T.Q8_0)
    qw = QWeight("exps", int(T.Q8_0), (n_exp, rows, cols), raw.view(np.uint8).reshape(n_exp * rows, -1))
    x = f32(n, k, cols) if per_slot else f32(n, cols)
    logits = f32(n, n_exp)

    def build(g):
        ids = g.top_k(_in(g, "l", logits.shape), k, "ids")
        w = g.take(_in(g, "l", logits.shape), ids, "w")
        g.outputs += [g.mul_mat_id(g.weight(qw), _in(g, "x", x.shape), ids, "y"),
                      g.div(w, g.sum_rows(w, "s"), "wn")]
    ref, gpu = run_both(cuda, build, {"x": x, "l": logits})
    assert nmse(gpu, ref) < 5e-4
