"""Decode steps replayed as CUDA graphs (backends/cuda/graphs.py), the parts a machine without
a GPU can check: dispatch tries a backend's graph runner first and walks the steps when it
declines, on the engine's real path; and which compiled graphs the cuda backend would capture.
On a GPU, `tests/gpu_parity.py graphs` compares replayed decoding with eager decoding (exact
tokens) and counts the replays; tests/gpu_check.sh runs it."""
import numpy as np
from gguf import GGMLQuantizationType as T
from synth import FakeModel
from test_graph_cache import generate

from hearthlm.backends import get_backend
from hearthlm.backends.cuda import graphs
from hearthlm.backends.cuda.weights import CudaWeight
from hearthlm.runtime import dispatch
from hearthlm.runtime.engine import Engine


class _Counting:
    """A runner as a GPU backend's: runs the walk itself (declining its first `decline` calls)."""

    def __init__(self, cg, decline: int) -> None:
        self.cg, self.decline, self.calls, self.ran, self.kept = cg, decline, 0, 0, 0

    def __call__(self, feed, cache_of, keep=frozenset()):
        self.calls += 1
        if self.calls <= self.decline:
            return None
        self.ran += 1
        self.kept += bool(keep)
        return [v if i in keep else np.asarray(v) for i, v in enumerate(dispatch.walk(self.cg, feed, cache_of))]


def _engine(backend) -> Engine:
    e = Engine(FakeModel("llama"), backend, n_ctx=256, kv_blocks=64, block_size=4)
    e.start()
    return e


def _graphs(e: Engine):
    return [entry.compiled for entry in e.graphs._graphs.values()]


def test_runner_first_and_the_walk_when_it_declines():
    plain = _engine(get_backend("reference"))
    try:
        want = generate(plain, [[1, 2, 3], [4, 5, 6, 7, 8]], 12)
    finally:
        plain.close()
    backend = get_backend("reference")
    runners = []
    backend.graph_runner = lambda cg: runners.append(_Counting(cg, decline=1)) or runners[-1]
    e = _engine(backend)
    try:
        got = generate(e, [[1, 2, 3], [4, 5, 6, 7, 8]], 12)
        cgs = _graphs(e)
    finally:
        e.close()
    assert got == want
    assert runners and all(cg.runner in runners for cg in cgs)
    assert sum(r.calls for r in runners) >= 12  # every step asked its runner
    assert sum(r.ran for r in runners) >= 10  # and it ran all but the first use of each graph
    # greedy steps leave the logits where they are (ids taken there): same tokens as above
    assert sum(r.kept for r in runners) >= 8


def test_no_runner_for_a_split_graph():
    from hearthlm.runtime.placement import offload
    ref, cpu = get_backend("reference"), get_backend("cpu")
    asked = []
    for b in (ref, cpu):
        b.graph_runner = lambda cg, b=b: asked.append(b.name)
    model = FakeModel("llama")
    e = Engine(model, offload({"cpu": cpu, "reference": ref}, len(model.kv_dims), 1), n_ctx=256, kv_blocks=64,
               block_size=4)
    e.start()
    try:
        generate(e, [[1, 2, 3]], 4)
        assert all(cg.n_copies for cg in _graphs(e))
    finally:
        e.close()
    assert asked == []


def _n_tokens(cg) -> int:
    return next(st for st in cg.steps if st.node.name == "tokens").node.shape[0]


def test_what_the_cuda_backend_captures(monkeypatch):
    e = _engine(get_backend("reference"))
    try:  # a 40-token prefill and a decode of 2 tokens a step
        generate(e, [[1 + i % 20 for i in range(40)], [1, 2]], 4)
        cgs = _graphs(e)
    finally:
        e.close()
    assert min(map(_n_tokens, cgs)) <= graphs.MAX_TOKENS < max(map(_n_tokens, cgs))
    # the weights as the cuda backend prepares them: quantized blocks (mmvq), not floats (cuBLAS)
    weights = [cg.steps[st.srcs[0]] for cg in cgs for st in cg.steps if st.node.op in graphs.PRODUCTS]
    assert weights
    for w in weights:
        monkeypatch.setattr(w, "value", CudaWeight(int(T.Q8_0), (1, 32), raw=np.zeros((1, 34), np.uint8)))
    monkeypatch.setattr(graphs, "GraphReplay", lambda backend, cg: ("replay", cg))
    for cg in cgs:
        assert (graphs.runner(None, cg) == ("replay", cg)) == (_n_tokens(cg) <= graphs.MAX_TOKENS)
    decode = min(cgs, key=_n_tokens)
    monkeypatch.setenv("HEARTHLM_CUDA_GRAPHS", "0")
    assert graphs.runner(None, decode) is None
    monkeypatch.delenv("HEARTHLM_CUDA_GRAPHS")
    assert graphs.runner(None, decode) == ("replay", decode)
    # an op that reads device data on the host (mul_mat_id's expert ids) is never captured
    st = next(st for st in decode.steps if st.kind is dispatch.KERNEL)
    monkeypatch.setattr(st.node, "op", next(iter(graphs.HOST_OPS)))
    assert graphs.runner(None, decode) is None
    monkeypatch.undo()
    # float weights, or the unfused attention's products, go to cuBLAS: CuPy cannot capture it
    for w in weights:
        monkeypatch.setattr(w, "value", CudaWeight(int(T.Q8_0), (1, 32), raw=np.zeros((1, 34), np.uint8)))
    monkeypatch.setattr(graphs, "GraphReplay", lambda backend, cg: ("replay", cg))
    assert graphs.runner(None, decode) == ("replay", decode)
    w = next(w for w in weights if w in decode.steps)
    monkeypatch.setattr(w, "value", CudaWeight(int(T.F16), (1, 32), f=np.zeros((1, 32), np.float32)))
    assert graphs.runner(None, decode) is None
    monkeypatch.setattr(w, "value", CudaWeight(int(T.Q8_0), (1, 32), raw=np.zeros((1, 34), np.uint8)))
    monkeypatch.setattr(st.node, "op", next(iter(graphs.BLAS_OPS)))
    assert graphs.runner(None, decode) is None
