"""Multi-device dispatch without a GPU: two CPU backends pose as a host and a device. Each
keeps its values in its own numpy subclass and refuses the other's in its kernels, so a
missing copy (or upload) fails loudly. For several split points (llama.cpp's -ngl 0, 1,
some, all), fused and unfused: the same logits and K/V as one backend, the copies the split
implies (the residual stream crossing once), every COPY between two different backends,
each backend's nodes in one run. Then mixed reference+cpu, fallbacks, the engine and the
Session (device=, n_gpu_layers=)."""
from __future__ import annotations

import importlib.util
import threading

import anyio
import numpy as np
import pytest
from synth import FakeModel, build, step_feed, weights
from test_backend_ops import nmse
from tiny_gguf import write_tiny

from hearthlm import BackendError, InvalidRequestError, Session
from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.backends.reference import ReferenceBackend
from hearthlm.core.graph import Op
from hearthlm.runtime import fusion
from hearthlm.runtime.dispatch import compile_graph, execute
from hearthlm.runtime.engine import Engine
from hearthlm.runtime.placement import Placement, offload, place
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.runtime.weights import WeightStore

N_LAYER = {"llama": 2, "gemma3": 6}  # gemma3: five sliding-window layers and one global
HAS_CUPY = importlib.util.find_spec("cupy") is not None


class Tagged(CPUBackend):
    """A CPU backend posing as a device: its values are views of its own ndarray subclass,
    its kernels refuse any other array, and it counts the copies it receives."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.copies = name, 0
        self.kind = type(f"On_{name}", (np.ndarray,), {})

    def _own(self, v):
        return v.view(self.kind) if isinstance(v, np.ndarray) else v

    def bind(self, node):  # what dispatch calls: each kernel checks where its sources live
        kernel = super().bind(node)

        def run(*srcs, **out):
            for s in srcs:
                if isinstance(s, np.ndarray) and type(s) is not self.kind:
                    raise AssertionError(f"{node.label} on {self.name} got a {type(s).__name__} value")
            return self._own(kernel(*(np.asarray(s) if isinstance(s, np.ndarray) else s for s in srcs), **out))
        return run

    def prepare_weight(self, w):
        return self._own(super().prepare_weight(w))

    def from_host(self, array):
        assert type(array) is np.ndarray, f"{self.name}.from_host got a {type(array).__name__}"
        return np.array(array).view(self.kind)

    def to_host(self, value):
        assert type(value) is self.kind, f"{self.name}.to_host got a {type(value).__name__}"
        return np.array(value, copy=True).view(np.ndarray)

    def copy_from(self, src, value):
        self.copies += 1
        return self.from_host(src.to_host(value))


def two(host="cpu0", dev="cpu1"):
    return {host: Tagged(host), dev: Tagged(dev)}


def compiled(graph, where):
    """`graph` compiled for a Placement, or for one backend (the trivial placement)."""
    p = where if isinstance(where, Placement) else Placement.single(where, 0)
    return compile_graph(graph, p, {name: WeightStore(b) for name, b in p.backends.items()})


def run(graph, where, feed, caches):
    return run_compiled(compiled(graph, where), where, feed, caches)


def run_compiled(cg, where, feed, caches):
    """Logits and the K/V caches after the step; each layer's caches uploaded to its backend."""
    up = (lambda il: where.backends[where.layers[il]]) if isinstance(where, Placement) else None
    local = {k: (up(k[1]).from_host(v) if up else v.copy()) for k, v in caches.items()}
    (out,) = execute(cg, feed, lambda n: local[(n.name, n.layer)])
    host = {k: np.asarray(v) for k, v in local.items()}
    return out, host


def check_split(cg):
    """Every COPY goes between two backends; each backend's compute nodes form one run."""
    g = cg.graph
    for t, b in zip(g.nodes, cg.backends):
        for s in t.srcs:
            where = cg.backends[g.nodes.index(s)]
            assert where == (t.params["src"] if t.op is Op.COPY else b), f"{t.label} on {b} reads {s.label} on {where}"
        if t.op is Op.COPY:
            assert t.params["src"] != b, t
    runs = [b for t, b in zip(g.nodes, cg.backends) if t.op not in (Op.INPUT, Op.WEIGHT, Op.CACHE)]
    firsts = [b for i, b in enumerate(runs) if i == 0 or runs[i - 1] != b]
    assert len(firsts) == len(set(firsts)) == cg.n_splits, firsts


def placed_run(arch, ws, shape, feed, caches, p: Placement, fused: bool):
    n = N_LAYER[arch]
    g = build(arch, ws, shape, n)
    cg = compiled(fusion.fuse(g) if fused else g, p)
    out, kv = run_compiled(cg, p, feed, caches)
    return cg, out, kv


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_split_points_match_one_device(arch, fused):
    n = N_LAYER[arch]
    feed, shape, caches = step_feed(np.random.default_rng(1), n)
    ws = weights(arch, n, seed=2)
    one = build(arch, ws, shape, n)
    base, base_kv = run(fusion.fuse(one) if fused else one, CPUBackend(), feed, caches)
    for k in sorted({0, 1, n // 2, n}):
        bes = two()
        p = Placement(bes, ["cpu0"] * (n - k) + ["cpu1"] * k)
        g, out, kv = placed_run(arch, ws, shape, feed, caches, p, fused)
        assert np.array_equal(out, base), k
        for key in caches:
            assert np.array_equal(kv[key], base_kv[key]), (k, key)
        check_split(g)
        # the residual stream (or, with every layer offloaded, the embeddings) crosses once;
        # the output head sits with the last layer, so nothing comes back
        assert (g.n_splits, g.n_copies) == ((1, 0) if k == 0 else (2, 1)), (k, g.n_splits, g.n_copies)
        assert bes["cpu1"].copies == g.n_copies and bes["cpu0"].copies == 0
        copied = [t.srcs[0].label for t in g.graph.nodes if t.op is Op.COPY]
        assert copied == ([] if k == 0 else [("inp_scaled" if arch == "gemma3" else "inp_embd")] if k == n
                          else [f"l_out-{n - k - 1}"]), copied


def test_plain_cpu_pair_copies_through_host():
    """Two plain CPU backends (no copy_from, identity host transfers, one shared arena): the
    copy must not alias its source's arena buffer, which later nodes reuse."""
    arch, n = "gemma3", N_LAYER["gemma3"]
    feed, shape, caches = step_feed(np.random.default_rng(7), n)
    ws = weights(arch, n, seed=8)
    base, _ = run(fusion.fuse(build(arch, ws, shape, n)), CPUBackend(), feed, caches)
    for k in (1, 3, n):
        p = offload({"cpu0": CPUBackend(), "cpu1": CPUBackend()}, n, k)
        _, out, _ = placed_run(arch, ws, shape, feed, caches, p, fused=True)
        assert np.array_equal(out, base), k


def test_weights_and_inputs_bind_per_backend():
    """Tied embeddings: the host reads token_embd for the lookup, the device its own for
    the head; inputs the device reads are uploaded there, not copied."""
    n = 2
    _, shape, _ = step_feed(np.random.default_rng(0), n)
    p = offload(two(), n, 1)
    cg = place(fusion.fuse(build("llama", weights("llama", n, raw=False), shape, n)), p)  # shapes only: no binding
    where = {}
    for t, b in zip(cg.graph.nodes, cg.backends):
        if t.op in (Op.WEIGHT, Op.INPUT):
            where.setdefault(t.name, set()).add(b)
    assert where["token_embd.weight"] == {"cpu0", "cpu1"}
    assert where["blk.0.attn_output.weight"] == {"cpu0"} and where["blk.1.attn_output.weight"] == {"cpu1"}
    assert where["output_norm.weight"] == {"cpu1"}
    assert where["tokens"] == {"cpu0"} and where["pos"] == where["out_rows"] == {"cpu0", "cpu1"}
    assert "cpu1" in cg.graph.dump(cg.backends)


@pytest.mark.parametrize("host", ["reference", "cpu"])
def test_mixed_reference_and_cpu(host):
    """Two different backends (only cpu takes out= buffers): reference's nodes allocate,
    cpu's use the arena, and the logits stay within the reference's tolerance."""
    arch, n = "gemma3", N_LAYER["gemma3"]
    feed, shape, caches = step_feed(np.random.default_rng(3), n)
    ws = weights(arch, n, seed=4)
    base, base_kv = run(fusion.fuse(build(arch, ws, shape, n)), ReferenceBackend(), feed, caches)
    dev = "cpu" if host == "reference" else "reference"
    make = dict(reference=ReferenceBackend, cpu=CPUBackend)
    for k in (1, 3, n):
        p = offload({host: make[host](), dev: make[dev]()}, n, k)
        g, out, kv = placed_run(arch, ws, shape, feed, caches, p, fused=True)
        check_split(g)
        assert g.n_copies == 1
        assert nmse(out, base) < 1e-7, k
        for key in caches:
            assert nmse(kv[key], base_kv[key]) < 1e-7, (k, key)
        planned = {b for b, o in zip(g.backends, g.plan.outs) if o is not None}
        assert planned == {"cpu"}


def test_fallback_to_host_when_the_device_lacks_an_op():
    """A device without flash attention: those nodes run on the host, with their inputs
    (query, the written K/V caches) copied there and the result copied back."""

    class NoAttn(Tagged):
        def supports(self, node):
            return node.op is not Op.ATTN and super().supports(node)

    arch, n = "llama", 2
    feed, shape, caches = step_feed(np.random.default_rng(5), n)
    ws = weights(arch, n, seed=6)
    base, base_kv = run(fusion.fuse(build(arch, ws, shape, n)), CPUBackend(), feed, caches)
    p = Placement({"cpu0": Tagged("cpu0"), "cpu1": NoAttn("cpu1")}, ["cpu1"] * n)
    g, out, kv = placed_run(arch, ws, shape, feed, caches, p, fused=True)
    assert np.array_equal(out, base)
    for key in caches:
        assert np.array_equal(kv[key], base_kv[key])
    assert all(b == "cpu0" for t, b in zip(g.graph.nodes, g.backends) if t.op is Op.ATTN)
    for t, b in zip(g.graph.nodes, g.backends):
        if t.op is Op.COPY:
            assert t.params["src"] != b
    assert g.n_copies == 1 + 4 * n  # embeddings; per layer q, K and V caches over, the result back


def test_placement_keys():
    bes = {"cpu": CPUBackend(), "cuda": ReferenceBackend()}
    assert offload(bes, 30, 15).key == "cpu:0-14|cuda:15-29"
    assert offload(bes, 30, None).key == offload(bes, 30, 99).key == "cpu:embd|cuda:0-29"
    for p in (offload(bes, 30, 0), offload({"cpu": bes["cpu"]}, 30, 5)):  # the trivial placement
        assert p.key == "cpu" and p.backends == {"cpu": bes["cpu"]} and p.layers == ["cpu"] * 30
    with pytest.raises(BackendError, match="unknown"):
        Placement(bes, ["cpu", "tpu"])


def generate(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    outs = [[] for _ in prompts]
    done = threading.Semaphore(0)
    for p, o in zip(prompts, outs):
        engine.submit(Request(prompt=list(p), params=SamplingParams(temperature=0.0), max_tokens=max_tokens,
                              kind=Kind.GENERATE,
                              on_token=lambda t, lp, o=o: o.append(t), on_finish=lambda r, e: done.release()))
    for _ in prompts:
        assert done.acquire(timeout=300)
    return outs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_on_two_backends(arch):
    """Same greedy tokens as one backend; each layer's K/V lives on its layer's backend; the
    graph cache keys graphs by placement."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    outs, engines = [], []
    model = FakeModel(arch, n_layer=3)
    for be in (CPUBackend(), offload(two(), 3, 2)):
        e = Engine(model, be, n_ctx=128, kv_blocks=32, block_size=4)
        e.start()
        try:
            outs.append(generate(e, prompts, 8))
        finally:
            e.close()
        engines.append(e)
    assert outs[0] == outs[1]
    e, p = engines[1], engines[1].graphs.placement
    assert e.graphs.key == "cpu0:0-0|cpu1:1-2" and engines[0].graphs.key == "cpu"
    assert [type(k).__name__ for k in e.kv.k] == ["On_cpu0", "On_cpu1", "On_cpu1"]
    assert p.backends["cpu1"].copies > 0 and p.backends["cpu0"].copies == 0
    assert (e.stats()["graph_splits"], e.stats()["graph_copies"]) == (2, 1)
    stores = e.graphs.stores
    assert "blk.2.ffn_up.weight" in stores["cpu1"]._prepared and "blk.2.ffn_up.weight" not in stores["cpu0"]._prepared


# ---- Session: device= and n_gpu_layers= ------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("placement") / "tiny.gguf", n_layer=3)


async def _greedy(path, **kw) -> tuple[list[int], str]:
    async with Session.open(str(path), n_ctx=64, **kw) as s:
        c = await s.generate(" the cat", max_tokens=8, temperature=0.0, ignore_eos=True)
        return c.token_ids, s.engine.graphs.key


async def test_session_hybrid_matches_cpu(tiny_path, monkeypatch):
    """device="cuda" with a CPU backend posing as the GPU: hybrid and full offload generate
    what device="cpu" does."""
    import hearthlm.session as session_mod
    real = session_mod.get_backend
    monkeypatch.setattr(session_mod, "get_backend", lambda name: Tagged("cuda") if name == "cuda" else real(name))
    base, key = await _greedy(tiny_path, device="cpu")
    assert key == "cpu" and len(base) == 8
    assert await _greedy(tiny_path, device="cuda", n_gpu_layers=1) == (base, "cpu:0-1|cuda:2-2")
    assert await _greedy(tiny_path, device="cuda") == (base, "cpu:embd|cuda:0-2")
    assert await _greedy(tiny_path, device="auto", n_gpu_layers=2) == (base, "cpu:0-0|cuda:1-2")


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here")
async def test_session_cuda_without_cupy(tiny_path):
    with pytest.raises(BackendError, match="(?s)cuda.*CuPy"):
        async with Session.open(str(tiny_path), device="cuda", n_ctx=64):
            pass
    _, key = await _greedy(tiny_path, device="auto")
    assert key == "cpu"


@pytest.mark.parametrize("kw, word", [
    (dict(device="tpu"), "device"),
    (dict(device="cuda", n_gpu_layers=-1), "n_gpu_layers"),
    (dict(device="cpu", n_gpu_layers=2), "n_gpu_layers"),
    (dict(n_gpu_layers=2), "n_gpu_layers"),
    (dict(backend="reference", device="cpu"), "not both"),
])
def test_session_bad_device_options(tiny_path, kw, word):
    async def main():
        async with Session.open(str(tiny_path), n_ctx=64, **kw):
            pass
    with pytest.raises(InvalidRequestError, match=word):
        anyio.run(main)
