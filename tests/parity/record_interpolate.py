"""Records ggml_interpolate (ggml-cpu's upscale) once, through llama-cpp-python 0.3.36's libggml (never in CI):

    /tmp/lcp-venv/bin/python tests/parity/record_interpolate.py

writes tests/data/ggml_interpolate.npz: a seeded random table (16, 16, 4) float32, as clip.cpp's
resize_position_embeddings lays out a position table ((x, y, n_embd) as ne0, ne1, ne2), and its resizing to each
grid of GRIDS (ny, nx) in the mode LFM2-VL's tower uses (bilinear | antialias), "<ny>x<nx>", each (ny * nx, 4)
row-major: grids larger, smaller and mixed."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

OUT = Path(__file__).parents[1] / "data" / "ggml_interpolate.npz"
GRIDS = [(32, 32), (22, 44), (14, 20), (8, 8), (5, 30), (16, 20), (7, 10)]
BILINEAR, ANTIALIAS = 1, 1 << 9  # GGML_SCALE_MODE_BILINEAR, GGML_SCALE_FLAG_ANTIALIAS


class _Params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _libs():
    import llama_cpp
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    for name, res, args in (("ggml_init", p, [_Params]), ("ggml_new_tensor_3d", p, [p, ctypes.c_int] + [ctypes.c_int64] * 3),
                            ("ggml_interpolate", p, [p, p] + [ctypes.c_int64] * 4 + [ctypes.c_uint32]),
                            ("ggml_get_data", p, [p]), ("ggml_new_graph", p, [p]),
                            ("ggml_build_forward_expand", None, [p, p]), ("ggml_free", None, [p])):
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    return base, cpu


def interpolate(table: np.ndarray, ny: int, nx: int, mode: int) -> np.ndarray:
    """(side, side, E) -> (ny * nx, E) through ggml_interpolate on one thread."""
    base, cpu = _libs()
    side, _, e = table.shape
    ctx = base.ggml_init(_Params(64 << 20, None, False))
    a = base.ggml_new_tensor_3d(ctx, 0, side, side, e)  # GGML_TYPE_F32, (x, y, E)
    src = np.ascontiguousarray(table.transpose(2, 0, 1), np.float32).reshape(-1)
    ctypes.memmove(base.ggml_get_data(a), src.ctypes.data, src.nbytes)
    out = base.ggml_interpolate(ctx, a, nx, ny, e, 1, mode)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, out)
    cpu.ggml_graph_compute_with_ctx(ctx, gf, 1)
    r = np.ctypeslib.as_array((ctypes.c_float * (nx * ny * e)).from_address(base.ggml_get_data(out))).copy()
    base.ggml_free(ctx)
    return r.reshape(e, ny, nx).transpose(1, 2, 0).reshape(ny * nx, e)


if __name__ == "__main__":
    table = np.random.default_rng(0).standard_normal((16, 16, 4)).astype(np.float32)
    out = {"table": table}
    for ny, nx in GRIDS:
        out[f"{ny}x{nx}"] = interpolate(table, ny, nx, BILINEAR | ANTIALIAS)
    np.savez_compressed(OUT, **out)
    print("wrote", OUT)
