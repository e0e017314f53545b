"""Decode steps replayed on the CPU (backends/cpu/replay.py): the recorded kernel calls give the
walk's tokens and log-probs bit for bit, on the real models and on synthetic ones; and each check
a recording must pass before it replays is seen to turn a wrong recording away (work a kernel
does outside `call`, a fresh array each step), while the outputs a caller holds and a cache that
moved are respected by the replays that follow."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from conftest import load_json
from gguf import GGMLQuantizationType as T
from gguf import quants
from synth import DIMS, FakeModel

from hearthlm import Session
from hearthlm.backends import get_backend
from hearthlm.backends.cpu import backend as cpu_backend
from hearthlm.backends.cpu import ops, replay
from hearthlm.core.graph import Op
from hearthlm.core.weights import QWeight
from hearthlm.runtime import dispatch, fusion
from hearthlm.runtime.engine import Engine, Kind, Request
from hearthlm.runtime.memory import Arena
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.runtime.weights import WeightStore

REAL = {"smollm2-135m-instruct": ("smollm2_path", "SmolLM2-135M-Instruct.Q4_1.visible.json"),
        "gemma-3-270m": ("gemma3_path", "gemma-3-270m-q4_k_m.visible.json"),
        "qwen2.5-coder-0.5b-instruct": ("qwen2_path", "qwen2.5-coder-0.5b-instruct.visible.json")}


def _runners(engine) -> list:
    return [e.compiled.runner for e in engine.graphs._graphs.values() if e.compiled.runner is not None]


def _counts(runners) -> dict:
    return {k: sum(r.counters[k] for r in runners) for k in ("captures", "replays", "declined")}


# every model with the default cache; the quantized cache's K writes (rope_set_rows_q) on one
@pytest.mark.parametrize("name,kv", [(n, "f16") for n in REAL] + [("smollm2-135m-instruct", "q4_0")])
async def test_replayed_decoding_is_the_walks_bit_for_bit(name, kv, request, monkeypatch):
    """Greedy ids, each step's top 5 ids and log-probs of two golden prompts, one at a time (so
    that decode steps are one token: what replays), with replay on and off.
    Mutation seen to fail (SmolLM2, f16): `_Program` keeping the recorded views of the outputs'
    buffers instead of rebuilding them over the buffer the OutBuffer hands out (the kernels then
    write one buffer and the step returns another).
    """
    path = request.getfixturevalue(REAL[name][0])
    cases = load_json(REAL[name][1])["cases"]
    prompts = sorted((c["prompt_ids"] for c in cases), key=len, reverse=True)[:2]
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("HEARTHLM_CPU_REPLAY", on)
        out = []
        async with Session.open(str(path), backend="cpu", n_ctx=256, kv_cache_type=kv) as s:
            for p in prompts:
                c = await s.generate(p, max_tokens=16, temperature=0, top_logprobs=5, ignore_eos=True)
                out.append((c.token_ids, [[t for t, _ in st] for st in c.top_logprobs],
                            [[lp for _, lp in st] for st in c.top_logprobs]))
            got[on] = (out, _counts(_runners(s.engine)))
    (with_replay, counts), (walked, none) = got["1"], got["0"]
    assert with_replay == walked
    assert counts["replays"] >= 20, counts  # 2 x 16 tokens, less the first steps' walks and recordings
    assert none["replays"] == none["captures"] == 0


async def test_several_streams_replay_as_they_walk(request, monkeypatch):
    """SmolLM2, three golden prompts decoded together (steps of 3 tokens, a graph of 4: the
    products through _matmul_n, _matmul_add_n and ffn_glu_n, q, k and v as strided slices): the
    same greedy ids, top 5 ids and log-probs with replay on and off, and the steps replayed.
    Mutation seen to fail: set_rows's source copied contiguous as before (declined, no replay)."""
    path = request.getfixturevalue(REAL["smollm2-135m-instruct"][0])
    prompts = [c["prompt_ids"] for c in load_json(REAL["smollm2-135m-instruct"][1])["cases"]][:3]
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("HEARTHLM_CPU_REPLAY", on)
        async with Session.open(str(path), backend="cpu", n_ctx=256) as s:
            cs = await asyncio.gather(*[s.generate(p, max_tokens=16, temperature=0, top_logprobs=5, ignore_eos=True)
                                        for p in prompts])
            got[on] = ([(c.token_ids, c.top_logprobs) for c in cs],
                       _counts([r for r in _runners(s.engine) if r.inputs and _tokens(r) == 4]))
    (with_replay, counts), (walked, none) = got["1"], got["0"]
    assert with_replay == walked
    assert counts["replays"] >= 8 and counts["declined"] == 0, counts
    assert none["replays"] == 0


def _tokens(runner) -> int:
    return next(st.node.shape[0] for st in runner.cg.steps if st.node.name == "tokens")


def _generate(engine: Engine, prompts, n: int, together: bool = False) -> list[list[tuple[int, float]]]:
    outs = [[] for _ in prompts]

    def one(batch):
        done = threading.Semaphore(0)
        for p, o in batch:
            engine.submit(Request(prompt=list(p), params=SamplingParams(temperature=0.0), max_tokens=n,
                                  kind=Kind.GENERATE, on_token=lambda t, lp, o=o: o.append((t, lp)),
                                  on_finish=lambda reason, err: done.release()))
        for _ in batch:
            assert done.acquire(timeout=300)
    pairs = list(zip(prompts, outs))
    for batch in ([pairs] if together else [[p] for p in pairs]):
        one(batch)
    return outs


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 3, 1, 4]]


def _q8(model: FakeModel) -> FakeModel:
    """The synthetic model with its matrices in Q8_0 (the int kernels' one-token paths, which
    record their calls; F32 products beyond a plain mul_mat do not, and a graph with one walks)."""
    for name, w in model.weights.items():
        if len(w.shape) == 2:
            a = w.raw.view(np.float32).reshape(w.shape)
            model.weights[name] = QWeight(name, int(T.Q8_0), w.shape, quants.quantize(a, T.Q8_0).view(np.uint8))
    return model


def _synth(arch: str, monkeypatch, on: bool, together: bool = False):
    monkeypatch.setenv("HEARTHLM_CPU_REPLAY", "1" if on else "0")
    e = Engine(_q8(FakeModel(arch)), get_backend("cpu"), n_ctx=256, kv_blocks=64, block_size=4)
    e.start()
    try:
        return _generate(e, PROMPTS, 12, together), _counts(_runners(e))
    finally:
        e.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_synthetic_models_replay_as_they_walk(arch, monkeypatch):
    """Q8_0 weights, Gemma 3's sliding window (its lower bounds
    written into a buffer of the node's by recorded calls) and embedding scale. Together, the
    streams' decode steps are of 3 tokens (a graph of 4), and replay too: the products each one
    recorded compiled call, q, k and v column slices of the fused product passed as they lie,
    gemma3's q and k norms included (ops.rms_norm_heads). Mutations seen to fail: the window's
    lower bounds from attn_bounds as before (fresh arrays each step): gemma3's one-token graph
    is then declined, no step replays; rope's input copied contiguous as before (a fresh array
    each step of several tokens): llama's 4-token graph is declined; the head norms' input
    copied contiguous (_rows, as before): gemma3's 4-token graph is declined.
    """
    want, _ = _synth(arch, monkeypatch, on=False)
    got, counts = _synth(arch, monkeypatch, on=True)
    assert got == want
    assert counts["replays"] >= 20, counts
    want3, _ = _synth(arch, monkeypatch, on=False, together=True)
    got3, counts3 = _synth(arch, monkeypatch, on=True, together=True)
    assert got3 == want3
    assert counts3["replays"] >= 3 and counts3["declined"] == 0, counts3


def _patched_norm(monkeypatch, kernel):
    """RMS_NORM_MUL bound to `kernel(node, x, w, out)` in place of the backend's own."""
    monkeypatch.setitem(cpu_backend._BINDERS, Op.RMS_NORM_MUL, lambda node: lambda x, w=None, out=None:
                        kernel(node, x, w, cpu_backend._buf(node, out)))


def _walked_alike(monkeypatch, kernel) -> None:
    """With RMS_NORM_MUL bound to `kernel`: the synthetic llama's tokens with replay on are the
    walk's, and no step replayed (each graph declined)."""
    _patched_norm(monkeypatch, kernel)
    want, _ = _synth("llama", monkeypatch, on=False)
    got, counts = _synth("llama", monkeypatch, on=True)
    assert got == want
    assert counts["replays"] == 0 and counts["declined"] >= 1, counts


def _norm(node, x, w, out):
    x2 = cpu_backend._rows(x)
    return x2, np.ascontiguousarray(w, np.float32).reshape(-1), node.params["eps"], out.reshape(x2.shape)


def test_work_outside_call_is_not_replayed(monkeypatch):
    """A kernel whose recorded call is not all its work (here the norm's output then doubled by
    numpy, unrecorded): the check run on NaN-filled buffers turns the recording away, and the
    tokens are the walk's. Mutation seen to fail: `Replay._check` returning None (no check):
    the replays leave the doubling out and the tokens part."""
    def kernel(node, x, w, out):
        replay.call(ops.rms_norm_1, *_norm(node, x, w, out))
        out *= np.float32(2.0)
        return out
    _walked_alike(monkeypatch, kernel)


def test_a_fresh_array_each_step_is_not_replayed(monkeypatch):
    """A kernel that hands its kernel a copy made in Python each step (the copy the recording
    keeps would be a past step's): the two recordings differ and the graph is walked. Mutation
    seen to fail: `_Recording.same` returning True: the replays read the recorded step's copy
    and the tokens part (the NaN check alone passes it: it reruns the recorded step itself)."""
    def kernel(node, x, w, out):
        x2, w1, eps, o = _norm(node, x, w, out)
        replay.call(ops.rms_norm_1, np.array(x2), w1, eps, o)
        return out
    _walked_alike(monkeypatch, kernel)


def _decode_graph(monkeypatch, on: bool):
    """A compiled (fused, as the engine's) one-token synthetic llama graph on the CPU, its cache
    arrays, and a step function."""
    monkeypatch.setenv("HEARTHLM_CPU_REPLAY", "1" if on else "0")
    from hearthlm.runtime.graph_cache import BatchShape
    model = _q8(FakeModel("llama"))
    bs, n_blocks = 4, 8
    shape = BatchShape(n_tokens=1, n_seqs=1, max_blocks=4, n_out=1, n_slots=n_blocks * bs, block_size=bs)
    cpu = get_backend("cpu")
    p = Placement.single(cpu, model.n_layer)
    cg = dispatch.compile_graph(fusion.fuse(model.build_graph(shape)), p, {n: WeightStore(b) for n, b in p.backends.items()},
                                arena=Arena())  # as a graph cache's: outputs into OutBuffers
    kv = (n_blocks * bs, DIMS["n_head_kv"], DIMS["head_dim"])
    caches = {(k, il): np.zeros(kv, np.float32) for k in ("cache_k", "cache_v") for il in range(model.n_layer)}
    table = np.array([[3, 1, 5, 2]], np.int32)

    def step(tok: int, pos: int, cache=None):
        slot = table[0, pos // bs] * bs + pos % bs
        feed = dict(tokens=np.array([tok], np.int32), pos=np.array([pos], np.int32),
                    tok_seq=np.zeros(1, np.int32), slots=np.array([slot], np.int32), block_table=table,
                    out_rows=np.zeros(1, np.int32))
        c = caches if cache is None else cache
        return dispatch.execute(cg, feed, lambda n: c[(n.name, n.layer)])[0]
    return cg, caches, step


def test_an_output_the_caller_holds_is_not_written(monkeypatch):
    """Replayed steps take their logits' buffer from the OutBuffer as the walk does: a past step's
    logits kept by the caller keep their values, and each step's equal the walk's.
    Mutation seen to fail: `Replay._takes` taking the buffers once and keeping them (the
    replays then write into the held logits)."""
    _cg, _c, walk = _decode_graph(monkeypatch, on=False)
    want = [walk(7 + i, i).copy() for i in range(10)]
    cg, _c, step = _decode_graph(monkeypatch, on=True)
    held = []
    for i in range(10):
        held.append(step(7 + i, i))
    assert cg.runner.counters["replays"] >= 6
    for i, (h, w) in enumerate(zip(held, want)):
        assert np.array_equal(h, w), f"step {i}'s logits changed after it"


def test_a_cache_that_moved_is_recorded_again(monkeypatch):
    """The engine may hand a graph other cache arrays (a resized cache): the replay records
    again rather than writing the old ones. Mutation seen to fail: `_same_key` ignoring the
    caches (the K/V of the steps after the move then go into the old arrays)."""
    cg, caches, step = _decode_graph(monkeypatch, on=True)
    for i in range(6):
        step(7 + i, i)
    assert cg.runner.counters["replays"] >= 2
    moved = {k: v.copy() for k, v in caches.items()}
    before = {k: v.copy() for k, v in caches.items()}
    for i in range(6, 9):
        step(7 + i, i, moved)
    for k in caches:
        assert np.array_equal(caches[k], before[k]), f"{k}: the old cache was written"
        assert not np.array_equal(moved[k], before[k]), f"{k}: the new cache was not"


def test_no_replay_for_a_graph_that_updates_a_recurrent_state():
    """The check before a replay runs a step twice: a graph with an op that updates a state from
    its own value (Mamba's scan, say) must not get a runner at all. Mutation seen to fail:
    `_updates` reading writes_cache alone (SSM_SCAN is updates_state)."""
    from types import SimpleNamespace as NS

    from hearthlm.core.backend import INPUT, KERNEL

    def cg(*ops):
        steps = [NS(kind=INPUT, index=0, out=None, node=NS(name="tokens", shape=(1,), op=Op.INPUT))]
        steps += [NS(kind=KERNEL, index=i + 1, out=None, node=NS(name="x", shape=(1,), op=op)) for i, op in enumerate(ops)]
        return type("CG", (), dict(steps=steps, outputs=[], statics=None))()  # weakly referable, as a CompiledGraph
    assert replay.runner(cg(Op.RMS_NORM, Op.SET_ROWS, Op.ROPE_SET_ROWS)) is not None
    assert replay.runner(cg(Op.RMS_NORM, Op.SSM_SCAN)) is None
    assert replay.runner(cg(Op.GATED_DELTA_NET)) is None


def test_replayed_kernels_are_called_through_their_entry_points(monkeypatch):
    """A replayed step calls each numba kernel's compiled entry point for the recorded arguments'
    types, not its dispatcher (which types every argument of every call again), and gives the
    walk's logits. Mutation seen to fail: `_entry` returning fn (no call resolved)."""
    _cg, _c, walk = _decode_graph(monkeypatch, on=False)
    want = [walk(7 + i, i).copy() for i in range(8)]
    cg, _c, step = _decode_graph(monkeypatch, on=True)
    got = [step(7 + i, i).copy() for i in range(8)]
    assert cg.runner.counters["replays"] >= 4
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    prog = next(s["prog"] for s in cg.runner.by_threads.values() if s["prog"] is not None)
    kinds = [type(fn).__name__ for fn, *_ in prog.steps]
    assert "CPUDispatcher" not in kinds, kinds
    assert kinds.count("builtin_function_or_method") >= 5 * FakeModel("llama").n_layer, kinds


def test_an_entry_point_only_for_the_exact_types():
    """`_entry` resolves a dispatcher only to an overload compiled for exactly the arguments'
    types: other types, keywords and plain functions keep the dispatcher (or function), which
    converts or compiles as a call would. Mutation seen to fail: any overload's entry point
    taken (`next(iter(overloads.values()))`): the float32 call would run float64 code."""
    import numba

    @numba.njit
    def twice(x):
        return x * 2

    a64, a32 = np.arange(3.0), np.arange(3, dtype=np.float32)
    twice(a64)
    ep = replay._entry(twice, (a64,), {})
    assert ep is not twice and np.array_equal(ep(a64), a64 * 2)
    assert replay._entry(twice, (a32,), {}) is twice  # not compiled for float32
    assert replay._entry(twice, (), {"x": a64}) is twice
    assert replay._entry(np.add, (a64, a64), {}) is np.add
