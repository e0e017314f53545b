"""Benchmark of the CPU weight kernels: matvec G weights/s and 512-token matmul GFLOP/s per type.

    python -m hearthlm.backends.cpu.bench_kernels [--types Q4_1,Q8_0] [--rows 32768] [--cols 2048]

Random weights (quantized with gguf.quants, or random blocks with sane scales for K-quants and IQ types).
The default matvec matrix (32768 x 2048) is larger than the L3 cache, like a model's weights.
Then one decode token's matrices of two real models (same shapes and types, random values).
Timings are the best of many runs: on a shared machine, other processes only add noise.
"""

import argparse
import time

import numba
import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from ..random_blocks import IQUANTS, KQUANTS, random_blocks
from .matmul import matmul
from .qtypes import pack_weight

# one token's weight matrices: (count, rows, cols, type); the tied embedding is the output projection
MODELS = {
    "SmolLM2-135M Q4_1": [(60, 576, 576, "Q4_1"), (60, 192, 576, "Q4_1"), (60, 1536, 576, "Q4_1"),
                          (30, 576, 1536, "Q4_1"), (1, 49152, 576, "Q8_0")],
    "gemma-3-270m Q4_K_M": [(18, 1024, 640, "Q5_0"), (18, 256, 640, "Q5_0"), (18, 256, 640, "Q8_0"),
                            (18, 640, 1024, "Q4_K"), (36, 2048, 640, "Q5_0"), (18, 640, 2048, "Q6_K"),
                            (1, 262144, 640, "Q8_0")],
}
DEFAULT_TYPES = ("F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,MXFP4,TQ1_0,TQ2_0,"
                 "IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M")


def random_raw(qtype: T, n_rows: int, n_cols: int, rng) -> np.ndarray:
    if qtype in KQUANTS or qtype in IQUANTS:  # gguf.quants cannot quantize them
        return random_blocks(qtype, n_rows, n_cols, rng)
    w = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    return w.view(np.uint8) if qtype == T.F32 else quants.quantize(w, qtype).view(np.uint8).reshape(n_rows, -1)


def best_time(fn, min_time=0.3, max_reps=200) -> float:
    fn()  # warm: compile, caches
    times, start = [], time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < min_time or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--mm-rows", type=int, default=1536, help="rows of the 512-token matmul")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default: all)")
    ap.add_argument("--no-models", action="store_true", help="skip the per-model decode timings")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"matvec {args.rows}x{args.cols}; matmul {args.mm_rows}x{args.cols} x {args.tokens} tokens")
    print(f"{'type':6} {'matvec Gw/s':>12} {'ms':>8} {'matmul GFLOP/s':>15} {'ms':>8} {'MB':>7}")
    for name in args.types.split(","):
        qtype = T[name]
        w = pack_weight(int(qtype), random_raw(qtype, args.rows, args.cols, rng), (args.rows, args.cols))
        x1 = rng.standard_normal((1, args.cols)).astype(np.float32)
        t_mv = best_time(lambda: matmul(w, x1))
        wm = pack_weight(int(qtype), random_raw(qtype, args.mm_rows, args.cols, rng), (args.mm_rows, args.cols))
        xm = rng.standard_normal((args.tokens, args.cols)).astype(np.float32)
        t_mm = best_time(lambda: matmul(wm, xm), min_time=0.5, max_reps=20)
        gw = args.rows * args.cols / t_mv / 1e9
        gf = 2.0 * args.mm_rows * args.cols * args.tokens / t_mm / 1e9
        print(f"{name:6} {gw:12.2f} {t_mv * 1e3:8.3f} {gf:15.1f} {t_mm * 1e3:8.2f} {w.nbytes / 1e6:7.1f}", flush=True)
    if not args.no_models:
        for model, mats in MODELS.items():
            bench_model(model, mats, rng)


def bench_model(model: str, mats: list, rng) -> None:
    """Matvec time of one decode token's weights (each distinct shape timed once, times its count)."""
    total_s = total_w = 0.0
    for count, rows, cols, name in mats:
        qtype = T[name]
        w = pack_weight(int(qtype), random_raw(qtype, rows, cols, rng), (rows, cols))
        x = rng.standard_normal((1, cols)).astype(np.float32)
        # many distinct matrices stream from memory; one repeated would sit in cache
        copies = [w] + [pack_weight(int(qtype), random_raw(qtype, rows, cols, rng), (rows, cols))
                        for _ in range(min(count, 8) - 1)]
        t = best_time(lambda: [matmul(c, x) for c in copies], min_time=0.2) / len(copies)
        total_s += count * t
        total_w += count * rows * cols
    print(f"{model}: one decode token's matvecs {total_s * 1e3:.2f} ms, "
          f"{total_w / 1e6:.0f} M weights, {total_w / total_s / 1e9:.1f} G weights/s", flush=True)


if __name__ == "__main__":
    main()
