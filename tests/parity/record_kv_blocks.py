"""Record ggml's own quantization of KV rows, once, for each quantized KV cache type (q8_0, q4_0,
q5_0, q5_1, iq4_nl): ggml-quants.c's quantize_row_*_ref (what llama.cpp's CPU set_rows calls for
these types) from llama-cpp-python's libggml-base (an oracle, never a dependency), on 256 blocks of
32 values (random scales from 1e-6 to 1e4, and the edge cases: an all-zero block, a block under
ggml's 1e-15, constant blocks, ties of magnitude, values on code boundaries)
-> tests/data/kv_blocks.npz. gguf.quants has no iq4_nl quantization: this is its oracle.
Run from the repo root with a Python that has llama_cpp:
  python tests/parity/record_kv_blocks.py"""
from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"q8_0": 34, "q4_0": 18, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}  # bytes per block of 32


def blocks() -> np.ndarray:
    rng = np.random.default_rng(38)
    x = (rng.standard_normal((256, 32)) * 10.0 ** rng.uniform(-6, 4, (256, 1))).astype(np.float32)
    x[0] = 0                        # d 0
    x[1] = 1e-17                    # under iq4_nl's GROUP_MAX_EPS
    x[2] = 3.5                      # constant: q5_1's d 0, its min the value
    x[3] = -2.0
    x[4, :2] = [5.0, -5.0]          # a tie of magnitude: the first one's sign sets d
    x[5] = np.linspace(-8, 7, 32)   # on q4_0's code boundaries
    x[6] = np.linspace(-16, 15, 32) / 3
    x[7, 7] = 1e4                   # one outlier
    return x


if __name__ == "__main__":
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    x = blocks()
    out = {"x": x}
    for name, nb in TYPES.items():
        y = np.zeros((len(x), nb), np.uint8)
        getattr(lib, f"quantize_row_{name}_ref")(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
                                                 ctypes.c_int64(x.size))
        out[name] = y
    np.savez_compressed(ROOT / "tests/data/kv_blocks.npz", llama_cpp_python=np.array(llama_cpp.__version__), **out)
