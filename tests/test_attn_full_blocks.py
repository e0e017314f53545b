"""core.array_ops.attn_full on the host: blocked over (heads, query rows) and spread over threads,
it still gives softmax attention within each run of equal seg values; and a vision encode on the
cpu backend lends it the backend's threads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core import array_ops
from hearthlm.model_zoo.vision.clip import load_mmproj
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import VisionEncoder

MMPROJ = Path(__file__).parent / "data" / "converted" / "gemma3-vision.mmproj.gguf"


def _softmax_attention(q, k, v, seg, scale):
    """Written out per run and head, in float64."""
    n, h, _ = q.shape
    group = h // k.shape[1]
    out = np.zeros((n, h, v.shape[2]))
    for s in np.unique(seg):
        idx = np.flatnonzero(seg == s)
        for i in range(h):
            a = q[idx, i].astype(np.float64) @ k[idx, i // group].T.astype(np.float64) * scale
            p = np.exp(a - a.max(axis=1, keepdims=True))
            out[idx, i] = (p / p.sum(axis=1, keepdims=True)) @ v[idx, i // group]
    return out.reshape(n, -1)


@pytest.mark.parametrize("block_floats,threads", [(1 << 20, 1), (64, 1), (64, 3), (300, 2)])
def test_blocks_and_threads_keep_softmax_attention(monkeypatch, block_floats, threads):
    """37 tokens in runs of 20, 5 and 12, 6 heads over 2 K/V heads (GQA): whole runs, blocks of a few
    query rows (64 floats) or of several heads (300), on 1 to 3 threads, all match the written-out
    softmax. Mutations: K/V head h % n_kv instead of h // group, the sum taken over the query rows
    (axis -2), or the row blocks' range dropping the last partial block, each fail it."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((37, 6, 8), (37, 2, 8), (37, 2, 8)))
    seg = np.repeat(np.arange(3, dtype=np.int32), [20, 5, 12])
    monkeypatch.setattr(array_ops, "HOST_BLOCK_FLOATS", block_floats)
    with array_ops.using_host_threads(threads):
        got = array_ops.attn_full(q, k, v, seg, np, scale=0.35)
    assert array_ops.host_threads() == 1  # restored after the block
    np.testing.assert_allclose(got, _softmax_attention(q, k, v, seg, 0.35), rtol=0, atol=2e-6)


@pytest.mark.parametrize("block_floats,threads", [(1 << 20, 1), (64, 3), (300, 2)])
def test_cpu_transposed_softmax_keeps_softmax_attention(monkeypatch, block_floats, threads):
    """The cpu backend's path (scores transposed, each column's softmax in backends.cpu.softmax) over
    the same runs, blocks and threads matches the written-out softmax; scale 20 puts scores past
    exp's float32 range unless each column's max is taken off. Mutations: exp_cols's max pass
    dropped (the first row's value kept), or the sums not zeroed before accumulating, each fail it."""
    from hearthlm.backends.cpu.softmax import softmax_cols
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((37, 6, 8), (37, 2, 8), (37, 2, 8)))
    seg = np.repeat(np.arange(3, dtype=np.int32), [20, 5, 12])
    monkeypatch.setattr(array_ops, "HOST_BLOCK_FLOATS", block_floats)
    with array_ops.using_host_threads(threads):
        got = array_ops.attn_full(q, k, v, seg, np, scale=20.0, softmax=softmax_cols)
    np.testing.assert_allclose(got, _softmax_attention(q, k, v, seg, 20.0), rtol=0, atol=2e-5)


def test_cpu_backend_runs_the_transposed_softmax(monkeypatch):
    """The cpu backend's ATTN_FULL kernel hands attn_full its column softmax. Mutation: the
    kernel's lambda without softmax= fails it."""
    from hearthlm.backends.cpu.softmax import softmax_cols
    from hearthlm.core.graph import Op
    seen, inner = [], array_ops.attn_full

    def spy(*args, **kw):
        seen.append(kw.get("softmax"))
        return inner(*args, **kw)
    monkeypatch.setattr(array_ops, "attn_full", spy)
    q = np.ones((3, 2, 4), np.float32)
    node = type("Node", (), {"params": {"scale": 0.5}, "shape": (3, 8)})()
    got = get_backend("cpu").kernels[Op.ATTN_FULL](node, q, q, q)
    assert seen == [softmax_cols]
    np.testing.assert_allclose(got, np.ones((3, 8)), rtol=1e-6)


def test_encoder_lends_attention_the_backends_threads(monkeypatch):
    """An encode on the cpu backend runs attn_full with as many threads as the backend's widest
    count (numba's), whatever the engine's last step chose. Mutation: VisionEncoder._encode
    without using_host_threads fails it (where numba has more than one thread)."""
    be = get_backend("cpu")
    want = max(be.thread_counts(), default=1)
    seen, inner = [], array_ops.attn_full

    def spy(*args, **kw):
        seen.append(array_ops.host_threads())
        return inner(*args, **kw)
    monkeypatch.setattr(array_ops, "attn_full", spy)
    vm = load_mmproj(MMPROJ)
    try:
        enc = VisionEncoder(vm, Placement.single(be, vm.config.n_layer))
        pixels = np.zeros((3, vm.config.image_size, vm.config.image_size), np.float32)
        enc.fill([Media(0, 16, b"zeros", pixels)])
    finally:
        vm.close()
    assert seen == [want] * vm.config.n_layer
    assert array_ops.host_threads() == 1
