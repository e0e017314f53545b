"""The cuda backend's host-side checks, which need no GPU: every .cu file compiles with nvcc
for sm_90 (as NVRTC will see it, headers inlined); the block unpacking of quants.cuh, compiled
as plain C++, matches gguf's dequantization exactly; the package imports without CuPy and says
what is missing. On a GPU, its ops are tested by the one op suite, test_backend_ops.py."""
import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import quants
from test_backend_ops import KQUANTS, LEGACY, make_raw, nmse

from hearthlm.backends.cuda.modules import CU_FILES, KERNEL_DIR, source
from hearthlm.core.errors import BackendError

QTYPES = LEGACY + KQUANTS


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
    # every warning is an error, ptxas's too (a register spill included): none goes unnoticed
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", "--Werror", "all-warnings",
                        "-Xptxas", "--warn-on-spills,--warning-as-error", *names],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for f in names:
        assert (tmp_path / f.replace(".cu", ".o")).stat().st_size > 0


_HARNESS = r"""
#include <math.h>
#include "quants.cuh"
#include "kv_quants.cuh"
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

// matmul.cu's quantize_q8 and the KV cache's block quantization, one chunk / block of 32 at a
// time, optionally under FTZ and DAZ (MXCSR) as the GPU runs them: CuPy compiles with -ftz=true
__attribute__((noinline)) static void q8_chunks(const float* x, long n, i8* xq, float* xd) {
    for (long c = 0; c < n; ++c) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[32 * c + i]));
        float d = q8_scale(amax);  // the lanes' warp_max is this loop
        for (int i = 0; i < 32; ++i) xq[32 * c + i] = (i8)q8_code(x[32 * c + i], d);
        xd[c] = d;
    }
}
__attribute__((noinline)) static void kv_blocks(int t, const float* x, long n, u8* out) {
    for (long b = 0; b < n; ++b)
        t == KV_Q8_0 ? kv_quantize<KV_Q8_0>(x + 32 * b, out + 34 * b) : kv_quantize<KV_Q4_0>(x + 32 * b, out + 18 * b);
}
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FTZ_DAZ(on, call) do { unsigned csr = _mm_getcsr(); if (on) _mm_setcsr(csr | 0x8040u); call; _mm_setcsr(csr); } while (0)
#define HAVE_FTZ 1
#else
#define FTZ_DAZ(on, call) call
#define HAVE_FTZ 0
#endif
extern "C" int host_quantize_q8(const float* x, long n, i8* xq, float* xd, int ftz) {
    if (ftz && !HAVE_FTZ) return 1;
    FTZ_DAZ(ftz, q8_chunks(x, n, xq, xd));
    return 0;
}
extern "C" int host_kv_quantize(int t, const float* x, long n, u8* out, int ftz) {
    if (ftz && !HAVE_FTZ) return 1;
    FTZ_DAZ(ftz, kv_blocks(t, x, n, out));
    return 0;
}
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


F32_MIN = np.finfo(np.float32).tiny  # the smallest normal float


def q8_1(x, daz=False):
    """Activations as matmul.cu's quantize_q8 makes them: int8 per 32, the scale, float sums per 16.
    A scale under the smallest normal float is 0, codes too (as the GPU's FTZ would flush it);
    daz: subnormal inputs read as 0, as on the GPU."""
    xb = x.reshape(-1, 32).astype(np.float32)
    if daz:
        xb = np.where(np.abs(xb) < F32_MIN, np.float32(0), xb)
    with np.errstate(under="ignore"):
        d = np.abs(xb).max(1) / np.float32(127)
    d = np.where(d < F32_MIN, np.float32(0), d).astype(np.float32)
    with np.errstate(under="ignore"):
        q = np.clip(np.rint(xb / np.where(d > 0, d, 1)[:, None]), -127, 127) * (d > 0)[:, None]
    return (np.ascontiguousarray(q.astype(np.int8)), np.ascontiguousarray(d, np.float32),
            xb.reshape(-1, 2, 16).sum(-1).astype(np.float32))


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


def _tiny_chunks():
    """Chunks of 32 whose q8 scale (amax / 127) is normal, subnormal or 0: tiny activations (a
    layer's output far below 1e-30) that the GPU's -ftz=true once turned into inf / NaN codes.
    Each chunk's values are all normal floats or its scale is subnormal for q8_0 and q4_0 alike,
    so that DAZ (subnormal inputs read as 0) changes no code here."""
    rng = np.random.default_rng(5)
    signs = np.where(rng.random((8, 32)) < 0.5, -1, 1)
    mags = rng.uniform(0.1, 1.0, (8, 32))
    amax = np.array([1.0, 3e-35, 1e-36, 5e-38, 1e-38, 2e-40, 0.0, 1.0])
    x = (signs * mags / mags.max(1, keepdims=True) * amax[:, None]).astype(np.float32)
    x[7, 1:] = 0  # one value and zeros
    return x.reshape(-1)


@pytest.mark.parametrize("ftz", [False, True], ids=["ieee", "ftz"])
def test_quantize_q8_of_tiny_chunks_on_host(host_quants, ftz):
    """quantize_q8's arithmetic (q8_scale, q8_code of quants.cuh) with and without FTZ/DAZ: a
    chunk whose scale is not a normal float is all zeros with scale 0, never inf / NaN codes, and
    every other chunk is llama.cpp's q8_1 (round(v / (amax / 127)))."""
    x = _tiny_chunks()
    n = x.size // 32
    xq, xd = np.full(x.size, 99, np.int8), np.full(n, np.nan, np.float32)
    P = ctypes.c_void_p
    if host_quants.host_quantize_q8(x.ctypes.data_as(P), ctypes.c_long(n), xq.ctypes.data_as(P),
                                    xd.ctypes.data_as(P), int(ftz)):
        pytest.skip("no FTZ/DAZ control on this host (x86's MXCSR)")
    wq, wd, _ = q8_1(x, daz=ftz)
    xq = xq.reshape(n, 32)
    tiny = np.abs(x.reshape(n, 32)).max(1) < 127 * F32_MIN
    assert tiny.tolist() == [False, False, True, True, True, True, True, False]
    assert (xd[tiny] == 0).all() and (xq[tiny] == 0).all(), (xd, xq[tiny])
    assert np.array_equal(xd, wd), (xd, wd)
    assert np.array_equal(xq, wq)
    assert (np.abs(xq[~tiny]).max(1) == 127).all()  # the largest value of a chunk codes +-127
    y = xd[:, None] * xq  # what the dot products read back: within half a step of each value
    assert (np.abs(y - x.reshape(n, 32)) <= np.maximum(xd[:, None] * 0.5001, 127 * F32_MIN)).all()


@pytest.mark.parametrize("kv", [8, 2], ids=["q8_0", "q4_0"])
def test_kv_quantize_of_tiny_blocks_on_host(host_quants, kv):
    """kv_quants.cuh's blocks of tiny values: the same bytes with FTZ/DAZ (the GPU) and without
    (the host, where 1 / d overflowed to inf for a subnormal d, undefined codes), gguf's bytes
    wherever the float scale is normal, and all of them read back as 0 or finite values."""
    x = _tiny_chunks()
    n, nb = x.size // 32, {8: 34, 2: 18}[kv]
    xb = x.reshape(n, 32)
    d = np.abs(xb).max(1) / {8: 127, 2: 8}[kv]  # ggml's float scale (q4_0's of the signed max)
    sub = d < F32_MIN
    assert sub.tolist() == [False, False, kv == 8, True, True, True, True, False]
    P = ctypes.c_void_p
    outs = []
    for ftz in (0, 1):
        out = np.zeros(n * nb, np.uint8)
        if host_quants.host_kv_quantize(kv, x.ctypes.data_as(P), ctypes.c_long(n), out.ctypes.data_as(P), ftz):
            pytest.skip("no FTZ/DAZ control on this host (x86's MXCSR)")
        blocks = out.reshape(n, nb)
        assert (blocks[sub, 0] == 0).all() and (blocks[sub, 1] & 0x7f == 0).all()  # a zero half scale
        blocks[sub, 1] = 0  # its sign: DAZ reads q4_0's subnormal max as +0, and d = +0 / -8 = -0
        outs.append(blocks)
    assert np.array_equal(outs[0], outs[1])
    blocks = outs[0]
    qt = {8: quants.GGMLQuantizationType.Q8_0, 2: quants.GGMLQuantizationType.Q4_0}[kv]
    vals = quants.dequantize(blocks, qt).reshape(n, 32)
    assert np.isfinite(vals).all()
    assert (vals[sub] == 0).all() and (blocks[sub, :2] == 0).all()
    assert (blocks[sub, 2:] == (0 if kv == 8 else 0x88)).all(), blocks[sub]  # 0, or q4_0's 8 | 8 << 4
    np.testing.assert_array_equal(blocks[~sub], quants.quantize(xb[~sub], qt))


def test_imports_without_cupy_and_says_what_is_missing(monkeypatch):
    from hearthlm.backends.cuda import backend
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    with pytest.raises(BackendError, match=r"hearthlm\[gpu-cuda13\]"):
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
    with pytest.raises(BackendError, match=r"hearthlm\[gpu-cuda13\]|no CUDA device"):
        CUDABackend()
