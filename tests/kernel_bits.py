"""Run by tests/test_kernel_cache.py in a fresh process: the CPU backend's float kernels on fixed
random inputs, each output's bytes hashed; on all of numba's threads and again on one. Prints
one JSON line: {"bits": {kernel: hash}, "bits_1_thread": ..., "compiled": n, "loaded": n} (the
kernels' overloads compiled here and loaded from numba's cache). With `--light`, without the
attention and dequant_rows kernels: 90 of the ~150 s of compiling on 2 cores (`make test`'s version;
their thread invariance is also tests/test_invariance_real.py's)."""
import hashlib
import json
import sys

import numba
import numpy as np

from hearthlm.backends.cpu import delta_net, halfs, kvquant, ops, ssm

KERNELS = [ops.glu, ops.glu_1, ops.glu_oai, ops.rms_norm, ops.rms_norm_1, ops.rms_norm_add, ops.rope,
           ops.rope_set_rows, ops.rope_set_rows_q, ops.set_rows, ops.attention, ops.kq, ops.kqv,
           halfs.dot_half, ssm.ssm_scan, ssm.ssm_conv, ssm.l2_norm, ssm.act, delta_net.gated_delta_net,
           kvquant.dequant_rows]
Q4_0, Q8_0 = kvquant.Q4_0, kvquant.Q8_0
F16_BITS = lambda a: a.astype(np.float16).view(np.uint16)  # noqa: E731


def outputs(heavy: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    f = lambda *s: (rng.standard_normal(s) * 2).astype(np.float32)  # noqa: E731
    out: dict[str, np.ndarray] = {}

    def run(name, kernel, *args, result=None):  # result: what the kernel writes (else its last argument)
        kernel(*args)
        out[name] = args[-1] if result is None else result

    g, u, x, w = f(6, 512), f(6, 512), f(6, 640), f(640)
    run("glu gelu", ops.glu, g, u, True, np.empty_like(g))
    run("glu silu", ops.glu, g, u, False, np.empty_like(g))
    run("glu_1 gelu", ops.glu_1, g[:1], u[:1], True, np.empty_like(g[:1]))
    run("glu_oai", ops.glu_oai, g, u, np.float32(1.702), np.float32(7.0), np.empty_like(g))
    run("rms_norm", ops.rms_norm, x, w, 1e-6, np.empty_like(x))
    run("rms_norm_1", ops.rms_norm_1, x[:1], w, 1e-6, np.empty_like(x[:1]))
    run("rms_norm_add", ops.rms_norm_add, x, w, f(6, 640), 1e-6, np.empty_like(x))
    n_tok, n_head, n_kv, d, bs = 6, 4, 2, 64, 16
    pos = np.arange(40, 40 + n_tok, dtype=np.int32)
    q, k = f(n_tok, n_head, d), f(n_tok, n_kv, d)
    rope = (d, 10000.0, 1.0, True, np.zeros(0, np.float64), 1.0, np.zeros(0, np.int64))  # ..., no M-RoPE comps
    pos_1 = pos[:, None]  # the rope kernels' positions: one component
    qr = np.empty_like(q)
    run("rope", ops.rope, q, pos_1, *rope, qr, *ops.rope_table(n_tok, d, 1), result=qr)
    # caches of 64 slots: float16 bits, and q4_0 / q8_0 blocks (18 / 34 bytes per 32 values)
    slots = np.arange(n_tok, dtype=np.int64) * 7 + 3
    kc16 = F16_BITS(f(64, n_kv, d))
    run("rope_set_rows f16", ops.rope_set_rows, k, pos_1, slots, *rope, kc16, *ops.rope_table(n_tok, d, 1), result=kc16)
    kc4 = np.zeros((64, n_kv, d // 32 * 18), np.uint8)
    vc4 = np.zeros((64, n_kv, d // 32 * 18), np.uint8)
    for cache in (kc4, vc4):
        ops.set_rows(cache, f(64, n_kv, d), np.arange(64, dtype=np.int64), Q4_0, 0)
    run("rope_set_rows_q q4_0", ops.rope_set_rows_q, k, pos_1, slots, *rope, kc4, Q4_0, 0, *ops.rope_table(n_tok, d, 1),
        result=kc4)
    c8 = np.zeros((64, n_kv, d // 32 * 34), np.uint8)
    run("set_rows q8_0", ops.set_rows, c8, k, slots, Q8_0, 0, result=c8)
    vc16 = F16_BITS(f(64, n_kv, d))
    bt = np.stack([rng.permutation(4).astype(np.int32) for _ in range(n_tok)])
    seq, lo, empty = np.arange(n_tok, dtype=np.int32), np.zeros(n_tok, np.int32), np.zeros(0, np.float32)
    for name, kk, vv, kinds, softcap, slopes in [("f16", kc16, vc16, (0, 0), 0.0, empty),
                                                 ("q4_0 softcap alibi", kc4, vc4, (Q4_0, Q4_0), 30.0,
                                                  np.linspace(0.1, 0.5, n_head).astype(np.float32))][:2 * heavy]:
        o = np.empty_like(q)
        ops.attention(q, kk, vv, seq, pos, lo, pos.copy(), bt, 0.125, bs, softcap, slopes, empty, o,
                      numba.get_num_threads(), *kinds, 0, 0)
        out[f"attention {name}"] = o
    if heavy:
        run("dequant_rows q4_0", kvquant.dequant_rows, kc4, slots, Q4_0, 0, np.empty((n_tok, n_kv, d), np.float32))
    kseq = f(2, 40, n_kv, d)  # (sequences, positions, KV heads, d)
    scores = np.empty((n_tok, n_head, 40), np.float32)
    seq2 = (np.arange(n_tok) % 2).astype(np.int32)
    run("kq", ops.kq, q, kseq, seq2, scores)
    probs = np.abs(scores) / np.abs(scores).sum(-1, keepdims=True)
    run("kqv", ops.kqv, probs, kseq, seq2, np.empty((n_tok, n_head, d), np.float32))
    wh = F16_BITS(f(96, 640) * 0.1)
    run("dot_half", halfs.dot_half, wh, True, x[:3], np.empty((3, 96), np.float32))
    # recurrences: 2 sequences of 3 tokens, states updated in place (a copy each run)
    seq_off, slot = np.array([0, 3, 6], np.int32), np.array([1, 0], np.int32)
    snap = np.zeros(0, np.int32)  # no per-token snapshots
    st = f(2, 8, 16, 32) * 0.1
    xs, dt, a, b, c = f(6, 8, 16), f(6, 8), -np.abs(f(8)), f(6, 2, 32), f(6, 2, 32)
    run("ssm_scan", ssm.ssm_scan, st.copy(), xs, dt, a, b, c, seq_off, slot, snap, np.empty((6, 8, 16), np.float32))
    cs = f(2, 3, 128)
    run("ssm_conv", ssm.ssm_conv, cs.copy(), f(6, 128), f(4, 128), seq_off, slot, snap, np.empty((6, 128), np.float32))
    run("l2_norm", ssm.l2_norm, x, 1e-6, np.empty_like(x))
    run("act softplus", ssm.act, x, True, np.empty_like(x))
    ds = f(2, 4, 32, 32) * 0.1
    qd, kd = f(6, 2, 32) * 0.2, f(6, 2, 32) * 0.2
    gd, beta = -np.abs(f(6, 4)), np.abs(f(6, 4)) * 0.1
    run("gated_delta_net", delta_net.gated_delta_net, ds.copy(), qd, kd, f(6, 4, 32), gd, beta, seq_off, slot,
        snap, 0.18, np.empty((6, 4, 32), np.float32))
    return out


def bits(heavy: bool) -> dict[str, str]:
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16] for k, v in outputs(heavy).items()}


if __name__ == "__main__":
    heavy = "--light" not in sys.argv
    res = {"bits": bits(heavy), "threads": numba.get_num_threads()}
    numba.set_num_threads(1)
    res["bits_1_thread"] = bits(heavy)
    res["compiled"] = sum(k.stats.cache_misses.total() for k in KERNELS)
    res["loaded"] = sum(k.stats.cache_hits.total() for k in KERNELS)
    print(json.dumps(res))
