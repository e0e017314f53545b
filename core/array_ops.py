"""Kernels that numpy and cupy run alike (each backend passes its array module): the vision
towers' ops, whose work is a reshape or a few large matrix products (BLAS / cuBLAS),
multi-position RoPE (a few elementwise passes), and each row's k largest logits (top_k_rows)."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

# scores computed at once at most (floats): on a GPU one head of SigLIP at 896 px (4096^2 = 64 MB);
# on the host a block that stays in cache (4 MB: 256 query rows of 4096) for the softmax's passes
ATTN_CHUNK_FLOATS = 1 << 24
HOST_BLOCK_FLOATS = 1 << 20


def patchify(img, p: int):
    """(B, C, H, W) -> (B * ny * nx, C * p * p): each p x p patch as one row, patches row-major
    and each flattened (c, dy, dx), as a (n_embd, C, p, p) conv kernel flattens: ggml_conv_2d
    with stride p is this times the kernel."""
    b, c, h, w = img.shape
    ny, nx = h // p, w // p
    x = img[:, :, :ny * p, :nx * p].reshape(b, c, ny, p, nx, p)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b * ny * nx, c * p * p)


def pool_avg_2d(x, xp, *, nx: int, ny: int, k: int):
    """(B * ny * nx, E) -> (B * (ny/k) * (nx/k), E): the mean of each k x k cell of a row-major
    patch grid (ggml_pool_2d AVG, kernel = stride = k, no padding; the remainder is dropped)."""
    e = x.shape[-1]
    b = x.shape[0] // (ny * nx)
    oy, ox = ny // k, nx // k
    g = x.reshape(b, ny, nx, e)[:, :oy * k, :ox * k].reshape(b, oy, k, ox, k, e)
    return (g.sum(axis=(2, 4), dtype=xp.float32) / xp.float32(k * k)).reshape(b * oy * ox, e).astype(xp.float32)


def attn_full(q, k, v, seg, xp, *, scale: float, dtype=None, rows: tuple[int, int] | None = None, softmax=None):
    """softmax(q k^T * scale) v with no causal mask: each token sees every token of its run of
    equal `seg` values (an image; a window of one) and no other. q (n, H, d), k (n, H_kv, d),
    v (n, H_kv, dv) -> (n, H * dv). `dtype`: the precision of the products (the reference's float64).
    `rows` (a, b): only query rows a..b, over all their keys -> (b - a, H * dv) (a tower run in turns).
    Computed in blocks of (heads, query rows) whose scores fit a cache on the host (numpy), spread
    over host_threads() threads there (numpy releases the GIL in its products and ufuncs).
    `softmax`: a backend's pass over float32 scores transposed, (h, m keys, r rows) -> exp(s - each
    column's max) in place, returning the sums (h, 1, r); the products are then taken transposed too
    (S^T = K Q^T, O^T = V^T P^T: BLAS's faster shapes on the host). Else the array module's passes."""
    n, n_head, d = q.shape
    h_kv, dv = k.shape[1], v.shape[2]
    group = n_head // h_kv
    dt = dtype or xp.float32
    q0, q1 = rows if rows is not None else (0, n)
    out = xp.empty((q1 - q0, n_head, dv), xp.float32)
    if q1 == q0:
        return out.reshape(0, n_head * dv)
    cuts = [0] + [int(i) + 1 for i in xp.flatnonzero(seg[1:] != seg[:-1])] + [n] if seg is not None else [0, n]
    host = getattr(xp, "__name__", "") == "numpy"
    budget = HOST_BLOCK_FLOATS if host else ATTN_CHUNK_FLOATS
    blocks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        m, q_lo, q_hi = hi - lo, max(lo, q0), min(hi, q1)
        if q_lo >= q_hi:
            continue
        span = q_hi - q_lo
        rows_ = min(span, max(1, budget // m))
        rows_ = -(-span // -(-span // rows_))  # blocks of equal size: no short last block
        heads = max(1, budget // (rows_ * m))  # several heads at once where the run is short
        blocks += [(lo, hi, h0, min(h0 + heads, n_head), r0, min(r0 + rows_, q_hi))
                   for h0 in range(0, n_head, heads) for r0 in range(q_lo, q_hi, rows_)]

    fused = softmax is not None and dt is xp.float32

    def block(b) -> None:
        lo, hi, h0, h1, r0, r1 = b
        kv = [h // group for h in range(h0, h1)]
        kv = slice(kv[0], kv[-1] + 1) if kv == list(range(kv[0], kv[-1] + 1)) else kv  # a view where it can be
        qq = q[r0:r1, h0:h1].transpose(1, 0, 2).astype(dt) * dt(scale)               # (h, r, d)
        kk = k[lo:hi, kv].transpose(1, 2, 0).astype(dt, copy=False)                  # (h, d, m)
        vv = v[lo:hi, kv].transpose(1, 0, 2).astype(dt, copy=False)                  # (h, m, dv)
        if fused:
            st = xp.matmul(kk.transpose(0, 2, 1), qq.transpose(0, 2, 1))                # (h, m, r)
            sums = softmax(st)                                                       # (h, 1, r)
            out[r0 - q0:r1 - q0, h0:h1] = (xp.matmul(vv.transpose(0, 2, 1), st) / sums).transpose(2, 0, 1)
            return
        s = xp.matmul(qq, kk)                                                        # (h, r, m)
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        # normalized after the product: (r, dv) divisions instead of (r, m)
        out[r0 - q0:r1 - q0, h0:h1] = (xp.matmul(s, vv) / s.sum(axis=-1, keepdims=True)).transpose(1, 0, 2)

    n_threads = min(host_threads(), len(blocks)) if host else 1
    if n_threads > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(n_threads, thread_name_prefix="hearthlm-attn") as ex:
            list(ex.map(block, blocks))
    else:
        for b in blocks:
            block(b)
    return out.reshape(q1 - q0, n_head * dv)


def rope_multi(x, pos, xp, *, n_rot: int, base: float, freq_scale: float, neox: bool, comps, freqs=None,
               mscale: float = 1.0):
    """Multi-position RoPE (core.graph's rope with `comps`): x (n, H, d) float32, pos (n, P) int;
    pair i of the first n_rot dims (i, i + n_rot/2 with neox, else 2i, 2i + 1) turns by
    pos[t, comps[i]] * freqs[i] (freqs: scaled RoPE's, else freq_scale * base^(-2i/n_rot)), cos
    and sin times mscale; the other dims pass. float64 angles and products, as the reference."""
    half = n_rot // 2
    inv = (xp.asarray(freqs, dtype=xp.float64) if freqs is not None
           else freq_scale * base ** (-2.0 * xp.arange(half, dtype=xp.float64) / n_rot))
    theta = pos[:, list(comps)].astype(xp.float64) * inv[None, :]  # (n, half)
    c, s = (mscale * xp.cos(theta))[:, None, :], (mscale * xp.sin(theta))[:, None, :]
    i0, i1 = (slice(0, half), slice(half, n_rot)) if neox else (slice(0, n_rot, 2), slice(1, n_rot, 2))
    x0, x1 = x[..., i0].astype(xp.float64), x[..., i1].astype(xp.float64)
    out = x.astype(xp.float32, copy=True)
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def top_k_rows(x, ks, xp):
    """Each row's ks[i] largest entries, as sampling does with top_k: (ids (n, max ks) int64,
    their values (n, max ks) float32, ok (n,) bool), host arrays. Row i's first ks[i] ids are
    ascending; among entries equal to its ks[i]-th largest, the lowest ids. ok[i] is False
    where row i has a NaN (its columns then unspecified). ks[i] = 1: the row's argmax (the
    first NaN where it has one, ok); 0: the row is not wanted. 0 <= ks[i] < x.shape[1]."""
    n, v = x.shape
    ks = np.asarray(ks, np.int64)
    kmax = max(int(ks.max(initial=0)), 1)
    kd = xp.asarray(ks)
    ok = ~xp.isnan(x).any(axis=1) | (kd == 1)
    xs = xp.where(ok[:, None], x, 0)  # a NaN row's entries: anything finite, its result unread
    top = xp.sort(xp.partition(xs, v - kmax, axis=1)[:, v - kmax:], axis=1)  # its kmax largest, ascending
    kth = top[xp.arange(n), kmax - xp.maximum(kd, 1)][:, None]
    above = xs > kth
    eq = xs == kth
    take = above | (eq & (xp.cumsum(eq, axis=1) <= (kd - above.sum(axis=1))[:, None]))
    take &= (kd > 1)[:, None]
    rows, cols = xp.nonzero(take)  # row-major: each row's ids ascending, ks[i] of them
    ids = xp.zeros((n, kmax), xp.int64)
    start = xp.cumsum(kd * (kd > 1)) - kd * (kd > 1)
    ids[rows, xp.arange(rows.shape[0]) - start[rows]] = cols
    ids[:, 0] = xp.where(kd == 1, xp.argmax(x, axis=1), ids[:, 0])
    vals = xp.take_along_axis(x, ids, axis=1)
    host = getattr(xp, "asnumpy", np.asarray)
    return host(ids), host(vals).astype(np.float32, copy=False), host(ok)


_local = threading.local()


def host_threads() -> int:
    """Threads the host's attn_full may use in this thread (1 unless inside `using_host_threads`)."""
    return getattr(_local, "threads", 1)


@contextmanager
def using_host_threads(n: int):
    """attn_full on numpy spreads its blocks over `n` threads in this block (a vision encode: the
    graph's other kernels are idle meanwhile, and BLAS is single-threaded while an engine runs)."""
    old = host_threads()
    _local.threads = max(1, int(n))
    try:
        yield
    finally:
        _local.threads = old
