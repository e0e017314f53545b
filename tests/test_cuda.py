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

from hearthlm.backends.cuda.modules import CU_FILES, KERNEL_DIR, source
from hearthlm.runtime.errors import BackendError
from test_backend_ops import KQUANTS, LEGACY, make_raw, nmse

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
