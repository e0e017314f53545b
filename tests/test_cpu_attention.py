"""The CPU flash-attention kernel (backends/cpu/ops.attention) against a float64 softmax, at the
shapes its code paths split on: head dims that are whole vectors (the score and V intrinsics) and
one that is not (the loops), contexts across several ATT_SPLIT parts and partial ATT_BLOCKs,
blocks scattered by the block table, GQA groups, and the merge of parts on one thread (decode)
or all (many tokens). A token's row is the same bitwise alone and in a batch."""
import numpy as np
import pytest

from hearthlm.backends.cpu import ops


def _case(rng, n_head, n_kv, d, ctxs, bs=16, cache=np.float16):
    n_blocks = max(ctxs) // bs + 2
    kc = rng.standard_normal((n_blocks * bs, n_kv, d)).astype(cache)
    vc = rng.standard_normal((n_blocks * bs, n_kv, d)).astype(cache)
    bt = np.stack([rng.permutation(n_blocks).astype(np.int32) for _ in ctxs])  # a sequence per token
    q = rng.standard_normal((len(ctxs), n_head, d)).astype(np.float32)
    pos = np.array([c - 1 for c in ctxs], np.int32)
    return q, kc, vc, bt, pos


def _run(q, kc, vc, bt, pos, seqs, scale, bs=16):
    bits = lambda c: c.view(np.uint16) if c.dtype == np.float16 else c  # noqa: E731
    out = np.empty(q.shape, np.float32)
    empty = np.zeros(0, np.float32)
    ops.attention(q, bits(kc), bits(vc), seqs, pos, np.zeros_like(pos), pos.copy(), bt, scale, bs, 0.0,
                  empty, empty, out, 2)
    return out


def _reference(q, kc, vc, bt, pos, seqs, scale, bs=16):
    n_head, n_kv = q.shape[1], kc.shape[1]
    out = np.empty(q.shape)
    for t in range(q.shape[0]):
        p = np.arange(pos[t] + 1)
        slots = bt[seqs[t], p // bs] * bs + p % bs
        for h in range(n_head):
            kh = h // (n_head // n_kv)
            s = kc[slots, kh].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[t, h] = w @ vc[slots, kh].astype(np.float64) / w.sum()
    return out


@pytest.mark.parametrize("n_head,n_kv,d", [(9, 3, 64), (4, 1, 128), (6, 2, 40)])
@pytest.mark.parametrize("cache", [np.float16, np.float32])
def test_attention_matches_softmax_and_is_batch_invariant(n_head, n_kv, d, cache):
    rng = np.random.default_rng(d * 7 + n_head)
    ctxs = [1, 17, 33, 128, 129, 300, 1000]  # inside a block, parts of ATT_SPLIT and partial ATT_BLOCKs
    q, kc, vc, bt, pos = _case(rng, n_head, n_kv, d, ctxs, cache=cache)
    seqs = np.arange(len(ctxs), dtype=np.int32)
    scale = 1.0 / np.sqrt(d)
    out = _run(q, kc, vc, bt, pos, seqs, scale)
    ref = _reference(q, kc, vc, bt, pos, seqs, scale)
    assert np.abs(out - ref).max() < 2e-5, np.abs(out - ref).max()
    for t in (0, 3, 6):  # alone: one token's decode, its merge on the calling thread
        alone = _run(q[t:t + 1], kc, vc, bt, pos[t:t + 1], seqs[t:t + 1], scale)
        np.testing.assert_array_equal(alone[0], out[t])
