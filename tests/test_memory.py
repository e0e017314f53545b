"""The memory planner: no two live intermediates share bytes; peak memory follows liveness
(a 30-layer decode graph needs at most 2x one layer's intermediates, as 1 layer does); the
CPU backend computes the same into planned buffers as into fresh arrays."""
import mmap
import weakref
from pathlib import Path

import numpy as np
import pytest
from conftest import vmflags_of
from synth import build, step_feed, weights
from test_backend_ops import nmse

from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.core.backend import HOST_LAZY_MIN, host_zeros
from hearthlm.core.graph import Op
from hearthlm.runtime import fusion
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.dispatch import compile_graph, execute
from hearthlm.runtime.memory import Arena, OutBuffer, _align, last_uses, nbytes, plan
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.weights import WeightStore

SMOLLM2 = dict(n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536, n_vocab=49152)


def decode_graph(n_layer: int, fused: bool):
    shape = BatchShape(n_tokens=1, n_seqs=1, max_blocks=128, n_out=1, n_slots=129 * 16, block_size=16)
    g = build("llama", weights("llama", n_layer, raw=False, **SMOLLM2), shape, n_layer, **SMOLLM2)
    return fusion.fuse(g) if fused else g


def check_no_overlap(g, p):
    """Planned buffers whose lifetimes overlap occupy disjoint bytes (a hand-over in place:
    the consumer starts where its donor ends, at the same offset)."""
    last = last_uses(g)
    idx = {id(n): i for i, n in enumerate(g.nodes)}
    end = {}
    for n in g.nodes:  # a view keeps its root alive
        r = n
        while r.op.props.view:
            r = r.srcs[0]
        end[id(r)] = max(end.get(id(r), -1), last.get(id(n), -1), idx[id(n)])
    spans = [(idx[k], end[k], off, off + _align(nbytes(g.nodes[idx[k]]))) for k, off in p.offsets.items()]
    for a in spans:
        for b in spans:
            if a is not b and a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]:
                pytest.fail(f"overlap: {a} {b}")


@pytest.mark.parametrize("fused", [True, False])
def test_peak_follows_liveness_not_depth(fused):
    g30, g1 = decode_graph(30, fused), decode_graph(1, fused)
    p30, p1 = plan(g30, arena=False), plan(g1, arena=False)
    layer0 = sum(_align(nbytes(n)) for n in g30.nodes if n.layer == 0 and id(n) in p30.offsets)
    assert p30.arena_bytes <= 2 * layer0, (p30.arena_bytes, layer0)
    assert p30.arena_bytes == p1.arena_bytes  # depth adds nothing
    assert p30.no_reuse_bytes > 20 * p30.arena_bytes


@pytest.mark.parametrize("fused", [True, False])
def test_no_live_overlap(fused):
    g = decode_graph(3, fused)
    check_no_overlap(g, plan(g, arena=False))
    _, shape, _ = step_feed(np.random.default_rng(0), 2)
    g = build("gemma3", weights("gemma3", 2, raw=False), shape, 2)
    g = fusion.fuse(g) if fused else g
    check_no_overlap(g, plan(g, arena=False))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("fused", [True, False])
def test_planned_equals_unplanned_on_cpu(arch, fused):
    n_layer = 2
    feed, shape, caches = step_feed(np.random.default_rng(4), n_layer)
    ws = weights(arch, n_layer, seed=5)
    outs = []
    for arena in (True, False):
        g = build(arch, ws, shape, n_layer)
        g = fusion.fuse(g) if fused else g
        be = CPUBackend() if arena else Unplanned()
        local = {k: v.copy() for k, v in caches.items()}
        cg = compile_graph(g, Placement.single(be, n_layer), {be.name: WeightStore(be)})
        outs.append(execute(cg, feed, lambda n: local[(n.name, n.layer)])[0])
        # most computed values (not leaves, views or outputs) live in the arena, where the backend takes it
        computed = [n for n in g.nodes if n.op not in (Op.INPUT, Op.WEIGHT, Op.CACHE, Op.RESHAPE, Op.SLICE)]
        n_planned = sum(o is not None for o in cg.plan.outs)
        assert n_planned >= len(computed) - len(g.outputs) - 4 if arena else n_planned == 0
    assert nmse(outs[0], outs[1]) < 1e-12


class Unplanned(CPUBackend):
    """The CPU's kernels, allocating their results: the capability declared off."""
    plans_memory = False


def test_an_output_buffer_is_used_again_only_when_nothing_holds_it():
    """Outputs stay out of the arena (the caller holds them past the step), but each run's fresh
    logits were fresh pages to fault in, inside the head's kernel time (Gemma 3 at 64 rows: 67
    MB). The next run takes the last buffer again only when nothing outside holds it: a dropped
    output is reused; a held one, or one with a view of it held, keeps its values while later
    runs (of other tokens) write elsewhere. Mutations seen to fail: `take` reusing whatever the
    count (a held output overwritten by the next run); no OutBuffer for outputs (no reuse after
    a drop)."""
    n_layer = 1
    feed, shape, caches = step_feed(np.random.default_rng(4), n_layer)
    g = fusion.fuse(build("llama", weights("llama", n_layer, seed=5), shape, n_layer))
    be = CPUBackend()
    cg = compile_graph(g, Placement.single(be, n_layer), {be.name: WeightStore(be)})

    def run(shift: int):
        local = {k: v.copy() for k, v in caches.items()}
        f = dict(feed, tokens=(feed["tokens"] + shift) % 50)
        return execute(cg, f, lambda n: local[(n.name, n.layer)])[0]

    first = run(0)
    want = first.copy()
    was = weakref.ref(first.base)
    del first
    again = run(0)
    assert again.base is was()  # dropped: its buffer served the second run
    np.testing.assert_array_equal(again, want)
    held, view = again, again[:, :7]  # a caller's: the next runs must write elsewhere
    del again
    for shift in (1, 2):
        other = run(shift)
        assert not np.array_equal(other, want)
        assert not np.shares_memory(other, held)
        del other
    np.testing.assert_array_equal(held, want)
    del held  # the view alone still holds the buffer
    other = run(3)
    assert not np.shares_memory(other, view)
    np.testing.assert_array_equal(view, want[:, :7])


def test_graphs_of_one_cache_share_their_output_buffers_within_a_bound(monkeypatch):
    """The graphs of one graph cache (one Arena) share each output position's buffer, as they
    share the arena: memory for the largest output, not one per graph and shape. A buffer over
    KEEP_BYTES is not kept (a one-off 512-row prompt's log-probs would hold 0.5 GB of Gemma 3's
    logits for good); a smaller output after a larger one takes its front. Mutations seen to
    fail: a pool per graph (the second graph's output not in the first's buffer); keeping
    whatever the size; a new buffer whenever the shape differs."""
    n_layer = 1
    feed, shape, caches = step_feed(np.random.default_rng(4), n_layer)
    be, arena = CPUBackend(), Arena()
    ws = weights("llama", n_layer, seed=5)
    cgs = [compile_graph(fusion.fuse(build("llama", ws, shape, n_layer)), Placement.single(be, n_layer),
                         {be.name: WeightStore(be)}, arena=arena) for _ in range(2)]

    def run(cg):
        local = {k: v.copy() for k, v in caches.items()}
        return execute(cg, feed, lambda n: local[(n.name, n.layer)])[0]

    want = run(cgs[0]).copy()
    out = run(cgs[1])
    assert out.base is arena.outs[0].buf  # the first graph's buffer, now the second's
    np.testing.assert_array_equal(out, want)
    del out
    pool = OutBuffer()
    big = pool.take((4, 8), np.float32)
    base = weakref.ref(big.base)  # a strong reference here would count as a holder
    del big
    small = pool.take((2, 3), np.float32)
    assert small.base is base() and pool.buf is base()  # the front of the larger one
    del small
    monkeypatch.setattr(OutBuffer, "KEEP_BYTES", 64)
    assert pool.take((4, 8), np.float32).base is base()  # it fits, so it is used (and kept)
    huge = pool.take((5, 8), np.float32)  # 160 bytes: larger, over the bound
    assert huge.base is not base() and pool.buf is None


def test_the_kv_cache_is_taken_in_small_pages_as_it_is_written():
    """A backend's zeros (the KV cache, recurrent states) from 4 MB are lazily faulted memory
    advised off huge pages: a fresh 2 MiB page can cost ~30 ms on a VM (a 512-token prefill's
    K/V writes went from 3 to 88 ms on average), so numpy's own huge pages are refused. Smaller
    ones are plain zeros. Mutation seen to fail: Backend.zeros back on np.zeros (VmFlags "hg")."""
    if not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        pytest.skip("needs /proc/self/smaps and madvise(MADV_NOHUGEPAGE)")
    kv = CPUBackend().zeros((HOST_LAZY_MIN // 1024 + 16, 8, 64), np.dtype(np.float16))  # just over the bound
    for at in (kv.ctypes.data, kv.ctypes.data + kv.nbytes // 2):  # numpy advises the aligned inside of its own
        flags = vmflags_of(at)
        assert "nh" in flags and "hg" not in flags, flags
    assert kv.dtype == np.float16 and kv.flags.writeable and kv.flags.c_contiguous and not kv.any()
    kv[-1, -1, -1] = 1.5
    assert kv.sum() == 1.5
    small = host_zeros((1000, 3), np.float32)
    assert small.shape == (1000, 3) and not small.any()
