"""Weight matmul and embedding lookup on the CPU: y = x @ W.T for every type in qtypes.

Up to BLAS_MIN_TOKENS tokens (decode, batches, prefill), x is quantized to int8 blocks of 32
(as ggml's q8_1, with codes, a scale, and the block sums that absorb the weights' offsets), and
each weight row is an integer dot product per sub-block (dot.py, 16 rows at a time, tokens in
pairs), so a token's result does not depend on the batch it came in. Beyond, rows are
dequantized a tile at a time and multiplied by BLAS. F16/BF16 weights are widened to float32 a
row at a time (halfs.py) and dotted with each token; from HALF_TOKENS_MIN tokens, they and F32
ones go to halfs.matmul_tokens (a token a vector lane); F32 ones below that to BLAS.
"""

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from gguf.constants import GGMLQuantizationType

from . import dot, halfs, ops, quantize
from .qtypes import LUTS, PackedWeight
from .replay import call

# the quantized types: integer kernels below BLAS_MIN_TOKENS, dequantize + BLAS from there.
# Measured on 2 cores with BLAS on one thread (as the engine runs it): the integer kernels beat
# the tiles at every count tried, 16 to 512 tokens (~1.5x at 512), both growing linearly; so
# the tiles stay only for counts beyond what was measured.
BLAS_MIN_TOKENS = 4096
SPLIT_MIN_MACS = 1 << 26  # a tiled matmul's multiply-adds from which its tiles go to several threads
# F16/BF16/F32: from here a token a vector lane (halfs.matmul_tokens: an FMA does 16 tokens),
# below it a row's weights a lane (dot_half; BLAS for F32), which wins for few tokens (measured:
# even at 8 on 896x896, 4864x896, 1536x384)
HALF_TOKENS_MIN = 8
TILE_ROWS = 512  # rows dequantized per BLAS call (at most): big enough for BLAS, within L2-L3


_CODES = np.arange(32, dtype=np.float32)  # a nibble layout's code is its value (5-bit ones too)
_VALUES = {name: np.array(v, np.float32) for name, v in LUTS.items()}
_VALUES["nib6"] = np.arange(-32, 32, dtype=np.float32)  # Q6_K: the value of code u is u - 32

def matmul(w: PackedWeight, x: np.ndarray, out: np.ndarray | None = None, xq=None) -> np.ndarray:
    """x (n_tokens, n_cols) float32 -> (n_tokens, n_rows) float32, written into `out` (a
    C-contiguous buffer of that shape) when given; `xq`: quantize_for(some weight, x)."""
    n_rows, n_cols = w.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.ndim == 2 and x.shape[1] == n_cols, (x.shape, w.shape)
    if x.shape[0] == 1 and w.kind >= 0:  # decode: quantize and multiply in one compiled call
        start_pool()
        y = np.empty((1, n_rows), dtype=np.float32) if out is None else out
        call(_matmul_n, dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, w.sub, x, y)
        return y
    if w.kind >= 0 and x.shape[0] < BLAS_MIN_TOKENS:
        if xq is None and out is not None:  # into the planned buffer, in one recorded call: replay takes it
            start_pool()
            call(_matmul_n, dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, w.sub, x, out)
            return out
        if xq is None or xq[0] != (w.n_pad, w.sub):
            xq = quantize_for(w, x)
        return _matmul_int(w, x.shape[0], xq[1], out)
    if w.layout in ("f32", "half") and x.shape[0] >= HALF_TOKENS_MIN:
        y = np.empty((x.shape[0], n_rows), dtype=np.float32) if out is None else out
        start_pool()
        halfs.matmul_tokens(w.w if w.layout == "f32" else w.qs, w.ggml_type == GGMLQuantizationType.F16, x, y,
                              numba.get_num_threads())
        return y
    if out is not None and out.flags.c_contiguous and w.layout in ("f32", "half"):  # into out: replay records it
        if w.layout == "f32":
            return call(np.matmul, x, w.w.T, out=out)
        call(halfs.dot_half, w.qs, w.ggml_type == GGMLQuantizationType.F16, x, out)
        return out
    if w.layout == "f32":
        y = x @ w.w.T
    elif w.layout == "half":
        y = _matmul_half(w, x)
    else:
        y = _matmul_tiles(w, x)
    if out is None:
        return y
    np.copyto(out, y)
    return out


def matmul_add(w: PackedWeight, x: np.ndarray, r: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ W.T + r (a residual of the output's shape)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, w.shape[1])
    if x2.shape[0] == 1 and w.kind >= 0 and r.dtype == np.float32 and r.size == w.shape[0]:
        start_pool()
        y = np.empty((1, w.shape[0]), dtype=np.float32) if out is None else out.reshape(1, -1)
        call(_matmul_add_n, dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, w.sub, x2,
             np.ascontiguousarray(r).reshape(1, -1), y)
        return y.reshape(r.shape) if out is None else out
    if (w.kind >= 0 and x2.shape[0] < BLAS_MIN_TOKENS and out is not None and out.flags.c_contiguous
            and r.dtype == np.float32 and r.size == out.size == x2.shape[0] * w.shape[0]):
        start_pool()  # several tokens in one recorded call, as one
        n = x2.shape[0]  # -1 cannot size an empty batch
        call(_matmul_add_n, dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, w.sub, x2,
             np.ascontiguousarray(r).reshape(n, w.shape[0]), out.reshape(n, w.shape[0]))
        return out
    return np.add(matmul(w, x2).reshape(r.shape), r, out=out)


_pool = []  # numba's thread pool started (by start_pool)


def start_pool() -> None:
    """Start numba's thread pool, once, from the calling thread, before the drivers below reach
    a parallel kernel from compiled code (without a pool that crashes). Lazily, from the first
    thread that multiplies: started from the main thread at import, the pool left the engine's
    worker thread at a third of its speed (OpenMP teams of a thread other than the one that
    made the first; measured), while one started from the worker serves every thread."""
    if not _pool:
        ops.start_threads(np.zeros(2, np.int64))
        _pool.append(True)


# Decode (one token, or a few streams' one each): quantizing x and the dot products (and what
# follows them) in one compiled call each, as a decode step makes a few of these per layer and
# each Python-level call costs microseconds; one call, too, is what replay.py records. The
# arithmetic is the general path's (quantize_x, then the same kernels), so results are bitwise equal.

@numba.njit(cache=True, nogil=True)
def _quantize1(x, n_pad, sub):
    xq = np.empty((1, n_pad), dtype=np.int8)
    xd = np.empty((1, n_pad // 32), dtype=np.float32)
    xs = np.empty((1, n_pad // sub), dtype=np.float32)
    quantize._quantize_rows(x, xq, xd, xs, sub)
    return xq, xd, xs


@numba.njit(cache=True, nogil=True)
def _quantize_n(x, n_pad, sub):
    n = x.shape[0]
    xq = np.empty((n, n_pad), dtype=np.int8)
    xd = np.empty((n, n_pad // 32), dtype=np.float32)
    xs = np.empty((n, n_pad // sub), dtype=np.float32)
    if n >= 4:
        quantize._quantize_rows_par(x, xq, xd, xs, sub)
    else:
        quantize._quantize_rows(x, xq, xd, xs, sub)
    return xq, xd, xs


@numba.njit(cache=True, nogil=True)
def _matmul_n(tag, qs, d, m, sup, ms, c, sub, x, y):
    xq, xd, xs = _quantize_n(x, d.shape[1] * sub, sub)
    dot.dot_any(tag, qs, d, m, sup, ms, c, xq, xd, xs, y)


@numba.njit(cache=True, nogil=True)
def _matmul_add_n(tag, qs, d, m, sup, ms, c, sub, x, r, y):
    t = np.empty(y.shape, dtype=np.float32)  # y may be r's buffer (memory.INPLACE)
    _matmul_n(tag, qs, d, m, sup, ms, c, sub, x, t)
    for i in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[i, j] = t[i, j] + r[i, j]


@numba.njit(cache=True, nogil=True)
def ffn_glu_n(tag, qg, dg, mg, sg, msg, cg, qu, du, mu, su, msu, cu, sub, x, gelu, out):
    """act(x Wg^T) * (x Wu^T) of n tokens into out (n, n_ff) whole; gate and up of one kind."""
    xq, xd, xs = _quantize_n(x, dg.shape[1] * sub, sub)
    g = np.empty(out.shape, dtype=np.float32)
    u = np.empty(out.shape, dtype=np.float32)
    dot.dot_any(tag, qg, dg, mg, sg, msg, cg, xq, xd, xs, g)
    dot.dot_any(tag, qu, du, mu, su, msu, cu, xq, xd, xs, u)
    if out.shape[0] < ops.PAR_MIN_ROWS:  # a parallel region costs more than a few rows
        ops.glu_1(g, u, gelu, out)
    else:
        ops.glu(g, u, gelu, out)


@numba.njit(cache=True, nogil=True)
def expert_matvecs(tag, qs, d, m, sup, ms, c, sub, x, ids, out):
    """One token through its k experts in one compiled call (decode: a Python-level call per
    expert cost ~20 us each, 3 x k per layer). x (1, 1 or k, cols) f32, ids (1, k) -> out
    (1, k, rows); qs, d, m, sup: typed lists of the experts' arrays. Each row is what matmul gives
    (one token: the same quantization and kernel as _matmul_n)."""
    k = ids.shape[1]
    cols = x.shape[2]
    n_pad = d[0].shape[1] * sub
    x1 = np.empty((1, cols), dtype=np.float32)
    y = np.empty((1, out.shape[2]), dtype=np.float32)
    for i in range(cols):
        x1[0, i] = x[0, 0, i]
    xq, xd, xs = _quantize1(x1, n_pad, sub)
    for j in range(k):
        if j > 0 and x.shape[1] > 1:  # a row per slot (the down projection's inputs)
            for i in range(cols):
                x1[0, i] = x[0, j, i]
            xq, xd, xs = _quantize1(x1, n_pad, sub)
        e = ids[0, j]
        dot.dot_any(tag, qs[e], d[e], m[e], sup[e], ms, c, xq, xd, xs, y)
        for i in range(out.shape[2]):
            out[0, j, i] = y[0, i]


def get_rows(w: PackedWeight, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ids (n,) int32 -> (n, n_cols) float32: the embedding lookup; into `out` (C-contiguous,
    float32, of that shape) where given and the rows need no trimming, else a new array."""
    ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    n_rows, n_cols = w.shape
    call(check_ids, ids, n_rows)
    if w.layout == "f32":
        return w.w[ids]
    if out is not None and w.n_pad == n_cols and out.dtype == np.float32 and out.flags.c_contiguous:
        call(_dequant, w, ids, out.reshape(ids.size, n_cols))
        return out
    out = np.empty((ids.size, w.n_pad), dtype=np.float32)  # (n, n_pad)
    _dequant(w, ids, out)
    return out[:, :n_cols] if w.n_pad != n_cols else out


def check_ids(ids: np.ndarray, n_rows: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        raise IndexError(f"row id out of range 0..{n_rows - 1}")


def _matmul_half(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)  # (n_tokens, n_rows)
    halfs.dot_half(w.qs, w.ggml_type == GGMLQuantizationType.F16, x, y)
    return y


def quantize_for(w: PackedWeight, x: np.ndarray):
    """x quantized for `w`'s integer kernels, to pass to several matmuls (gate and up) as `xq`;
    None where w's kernels take x as it is."""
    n_tok = x.shape[0]
    if w.kind < 0 or n_tok >= BLAS_MIN_TOKENS:
        return None
    return (w.n_pad, w.sub), quantize.quantize_x(np.ascontiguousarray(x, dtype=np.float32), w.n_pad, w.sub)


def _matmul_int(w: PackedWeight, n_tok: int, prepared, out: np.ndarray | None = None) -> np.ndarray:
    y = np.empty((n_tok, w.shape[0]), dtype=np.float32) if out is None else out  # (n_tokens, n_rows)
    dot.dot_any(dot.TAGS[w.kind], w.qs, w.d, w.m, w.sup, w.ms, w.c32, *prepared, y)
    return y


def _matmul_tiles(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    """Tiles of rows dequantized and multiplied by BLAS (on one thread, as the engine runs it),
    the tiles shared out over numba's thread count of threads of our own: BLAS's own threads
    would spin between calls against numba's (see runtime.engine)."""
    n_rows, n_cols = w.shape
    n_tok = x.shape[0]
    if w.n_pad != n_cols:
        x = np.pad(x, ((0, 0), (0, w.n_pad - n_cols)))
    xt = np.ascontiguousarray(x.T)  # (n_pad, n_tokens)
    yt = np.empty((n_rows, n_tok), dtype=np.float32)  # (n_rows, n_tokens)
    # threads of our own only for work that outweighs handing it over: a 384x384 weight at 72 tokens
    # (MiniLM's) took 0.34 ms split in two, 0.22 ms on one thread
    k = max(1, min(numba.get_num_threads(), n_rows // 64)) if n_rows * w.n_pad * n_tok >= SPLIT_MIN_MACS else 1
    share = -(-n_rows // k)  # each thread's rows, in tiles of at most TILE_ROWS

    def part(i: int) -> None:
        lo, hi = i * share, min((i + 1) * share, n_rows)
        tile = np.empty((min(TILE_ROWS, hi - lo), w.n_pad), dtype=np.float32)
        for r0 in range(lo, hi, TILE_ROWS):
            r1 = min(r0 + TILE_ROWS, hi)
            t = tile[: r1 - r0]
            _dequant(w, np.arange(r0, r1, dtype=np.int32), t)  # nogil, as BLAS
            np.matmul(t, xt, out=yt[r0:r1])
    if k <= 1:
        part(0)
    else:
        done = [tile_pool(k - 1).submit(part, i) for i in range(1, k)]
        part(0)
        for f in done:
            f.result()
    return np.ascontiguousarray(yt.T)


_pools: dict[int, ThreadPoolExecutor] = {}


def tile_pool(n: int) -> ThreadPoolExecutor:
    if n not in _pools:
        _pools[n] = ThreadPoolExecutor(n, thread_name_prefix="hearthlm-tiles")
    return _pools[n]


def _dequant(w: PackedWeight, rows: np.ndarray, out: np.ndarray) -> None:
    if w.layout == "half":
        halfs.widen_rows(w.qs, w.ggml_type == GGMLQuantizationType.F16, rows, out)
        return
    if w.layout == "i8":
        quantize.dequant_i8(w.qs, w.d, w.m, w.sup, w.ms, np.float32(w.c), w.sub, rows, out)
    else:  # nib5, nib6: the same, plus bits; nib6 and the lookup layouts: their tables' values
        quantize.dequant_nib(w.qs, w.d, w.m, w.sup, w.ms, np.float32(w.c), w.sub, rows, out,
                             _VALUES.get(w.layout, _CODES))
