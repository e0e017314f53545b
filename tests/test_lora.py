"""LoRA adapters chosen per request (#42), on tiny random models and adapters written as llama.cpp's
convert_lora_to_gguf.py writes them (tests/parity/lora.py): parity with llama.cpp's outputs recorded
once (tests/parity/record_lora.py: scale 1.0, 0.5, two adapters, the base); a request's rows the
same whatever the other rows' adapters; graphs reused when only the assignment changes, today's
graph where no request uses one; prefix blocks keyed by adapter set; unloading while in use;
bad input refused by name while the session keeps serving."""
import json
import sys
from collections import Counter
from pathlib import Path

import anyio
import gguf
import numpy as np
import pytest

from hearthlm import Session
from hearthlm.backends import get_backend
from hearthlm.bench.lora_files import write_lora
from hearthlm.core.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from hearthlm.core.graph import Op
from hearthlm.model_zoo.adapters import load_adapter
from hearthlm.model_zoo.model import load_model
from hearthlm.runtime import fusion
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import ModelRunner, open_memory
from hearthlm.runtime.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402
from models import PROMPTS, write  # noqa: E402
from record_lora import BASES, CASES, files  # noqa: E402

RECORDED = json.loads((Path(__file__).parent / "data" / "lora_parity.json").read_text())
T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return files(tmp_path_factory.mktemp("lora"), "qwen2")


def _opened(ads) -> dict:
    return {n: str(p) for n, p in ads.items()}


def test_every_case_is_recorded():
    assert set(RECORDED) == {f"{b}/{c}" for b in BASES for c in CASES}, "record it: tests/parity/record_lora.py"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("base", BASES)
async def test_matches_llama_cpp(tmp_path, monkeypatch, base, backend):
    """Each case (the base, adapter a at 1.0 and 0.5, a with b at 0.5: b with alpha 0 and on the
    LM head) against llama.cpp's greedy steps and top 5, F32 on both sides (0.05 nats). Mutations:
    the cpu kernel ignoring alpha / rank (scale alone) fails every adapter case; the LM head left
    without its adapter (the hook's output-rows branch returning y) fails a_b."""
    monkeypatch.setattr(golden, "TOP1_LOGPROB_TOL", 0.05)
    m, ads = files(tmp_path, base)
    failures = []
    async with Session.open(str(m), backend=backend, n_ctx=256, adapters=_opened(ads)) as s:
        for case, scales in CASES.items():
            for i, rec in enumerate(RECORDED[f"{base}/{case}"]):
                c = await s.generate(rec["prompt_ids"], max_tokens=len(rec["greedy_ids"]), temperature=0,
                                     top_logprobs=5, adapters=scales or None)
                why = golden.compare(rec, c.token_ids, c.top_logprobs, c.finish_reason, topk_tol=0.05)
                if why:
                    failures.append(f"{case} prompt {i}: {why}")
    assert not failures, "\n".join(failures)


# ---- the runner: rows of a mixed batch ----

def _runner(model_path, ads, backend):
    m = load_model(model_path)
    for n, p in ads.items():
        m.adapters.add(load_adapter(p, n, m))
    place = Placement.single(get_backend(backend), m.config.n_layer)
    mem = open_memory(m, place, n_ctx=128, kv_blocks=64, block_size=16, max_seqs=8)
    return m, ModelRunner(m, place, mem, n_ctx=128, max_batch_tokens=128, max_seqs=8, tune_threads=False)


def _step(m, run, sets, decode: bool, row: int = 0) -> np.ndarray:
    """Request `row`'s logits of one step over requests with adapter sets `sets` (None: the base)."""
    prompts = [PROMPTS[0], PROMPTS[1], [5, 6, 7]]
    prompts.insert(row, prompts.pop(0))  # the request of interest has PROMPTS[0] wherever it is
    rs = []
    for p, s in zip(prompts, sets):
        lora = tuple(sorted((m.adapters.names[k], v) for k, v in (s or {}).items()))
        r = Request(prompt=list(p), params=SamplingParams(temperature=0.0), kind=Kind.GENERATE, max_tokens=4,
                    on_token=lambda t, lp: None, on_finish=lambda reason, err: None, lora=lora)
        assert run.memory.admit(r) and run.memory.grow(r, len(p) + 4)
        r.n_computed = len(p) - 1 if decode else 0
        rs.append(r)
    out = run.run(StepPlan([Scheduled(r, len(r.prompt) - r.n_computed, True) for r in rs], [])).logits
    for r in rs:
        run.memory.release(r)
    return out[row].copy()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("loaded", ["a", "ab"])
def test_a_row_is_the_same_whatever_the_others_use(qwen2, backend, decode, loaded):
    """A request's logits are bitwise the same in a batch whatever adapters the other rows use (or
    none), for a request with an adapter and one without; alone they are too on the reference, and on
    the cpu as close as the base model's own are alone and batched (its matmuls' paths differ by row
    count, adapters or not). One adapter loaded (the cpu's one-adapter kernel) and two (its list
    kernel). Mutations: either cpu kernel taking row 0's scale for every row (`s[0, col]`,
    `s[0, cols[i]]`) fails it; the runner filling every request's scales from row 0 (`off` not
    advanced) fails it."""
    base, ads = qwen2
    m, run = _runner(base, {n: p for n, p in ads.items() if n in loaded}, backend)
    other = {"a": 0.5} if loaded == "a" else {"b": 1.0}
    try:
        for mine in ({"a": 1.0}, None):
            alone = _step(m, run, [mine], decode)
            mixes = [_step(m, run, [x, mine, y], decode, row=1) for x, y in
                     ([None, other], [{"a": 2.0, **other}, None], [{"a": 2.0}, {"a": 1.0}], [None, None])]
            assert all(np.array_equal(mixes[0], x) for x in mixes[1:]), f"{mine}: rows depend on the others' adapters"
            if backend == "reference":
                assert np.array_equal(alone, mixes[0])
            else:
                # AVX-512 hosts: within 1e-4; a 2-core Zen 3 without it (2026-12-07): 2.3e-4
                assert np.abs(alone - mixes[0]).max() < (3e-4 if golden.avx2_host() else 1e-4)
        assert not np.allclose(_step(m, run, [{"a": 1.0}], decode), _step(m, run, [None], decode), atol=1e-2)
    finally:
        m.close()


def test_graphs_reused_when_only_the_assignment_changes(qwen2):
    """Steps of the same size whose rows use other adapters hit the cached graph ("lora_scale" is an
    input); a step without adapters builds today's graph (no LORA node, the same nodes as a model with
    none loaded), which reads the same base weights. Mutations: shape.lora holding only the adapters the step's
    requests use misses; fusion without the mul_mat_lora rule (a LORA node after each product), or
    stack_matmuls leaving LoRA'd q, k and v apart, fails the node counts; stacking a LoRA'd FFN's gate and up
    (a third packed copy of them) fails the last assertion."""
    m, run = _runner(*qwen2, "cpu")
    try:
        _step(m, run, [{"a": 1.0}, None, None], False)
        misses = run.graphs.counters["graph_cache_misses"]
        for sets in ([{"b": 1.0}, None, None], [{"a": 1.0}, {"b": 0.5}, {"a": 1.0, "b": 1.0}], [None, {"b": 1.0}, None]):
            _step(m, run, sets, False)
        assert run.graphs.counters["graph_cache_misses"] == misses
        shape = BatchShape(n_tokens=8, n_seqs=2, max_blocks=4, n_out=2, n_slots=64, block_size=16)
        plain = load_model(qwen2[0])
        try:
            want = [(n.op, n.name, n.shape) for n in plain.build_graph(shape).nodes]
        finally:
            plain.close()
        assert [(n.op, n.name, n.shape) for n in m.build_graph(shape).nodes] == want
        g = m.build_graph(BatchShape(**{**shape.__dict__, "lora": tuple(sorted(m.adapters.live))}))
        lora = [n for n in g.nodes if n.op is Op.LORA]
        assert len(lora) == 7 * m.config.n_layer + 1  # a: 7 projections a layer; b: those and the LM head
        assert sum(len(n.params["cols"]) == 2 for n in lora) == 7 * m.config.n_layer
        # each product in one node with its adapters, the residual adds and the gated FFN fused as without,
        # q, k and v stacked as without
        fused, plain_fused = (Counter(n.op for n in fusion.fuse(gr).nodes) for gr in (g, m.build_graph(shape)))
        assert fused[Op.MUL_MAT_ADD_LORA] == 2 * m.config.n_layer and fused[Op.FFN_GLU_LORA] == m.config.n_layer
        assert fused[Op.MUL_MAT_LORA] == plain_fused[Op.MUL_MAT] and not fused[Op.LORA] and not fused[Op.MUL_MAT]
        assert fused[Op.SLICE] == plain_fused[Op.SLICE] > 0
        # and read only the base weights the plain graph reads: no stacked copy of a LoRA'd FFN's gate and up
        weights = lambda graph: {n.name for n in fusion.fuse(graph).nodes if n.op is Op.WEIGHT and ".lora_" not in n.name}  # noqa: E731
        assert weights(g) <= weights(m.build_graph(shape)), weights(g) - weights(m.build_graph(shape))
    finally:
        m.close()


# ---- the session ----

KW = dict(max_tokens=10, temperature=0, ignore_eos=True)


async def test_mixed_batch_gives_each_request_its_own_output(qwen2):
    """Five requests at once (a, the base, b, a+b, a at 2.0) give the tokens each gives alone.
    Mutation: the runner giving every row the first request's adapters fails it."""
    base, ads = qwen2
    prompts = [PROMPTS[0], PROMPTS[1], [5, 6, 7], list(range(100, 109)), [77] * 20]
    sets = [{"a": 1.0}, None, {"b": 1.0}, {"a": 0.5, "b": 1.0}, {"a": 2.0}]
    async with Session.open(str(base), n_ctx=256, adapters=_opened(ads)) as s:
        alone = [(await s.generate(p, adapters=a, **KW)).token_ids for p, a in zip(prompts, sets)]
    async with Session.open(str(base), n_ctx=256, adapters=_opened(ads)) as s:
        res = {}

        async def run(i):
            res[i] = (await s.generate(prompts[i], adapters=sets[i], **KW)).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
    assert [res[i] for i in range(len(prompts))] == alone
    assert len({tuple(t) for t in alone}) == len(alone)


async def test_prefix_blocks_are_keyed_by_the_adapter_set(qwen2):
    """A 40-token prompt computed with the base is not reused for adapter a (nor a at another scale),
    and a's blocks are reused by a. Mutation: _root returning None (blocks keyed by tokens alone) fails it."""
    base, ads = qwen2
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    async with Session.open(str(base), n_ctx=256, adapters=_opened(ads)) as s:
        want = (await s.generate(prompt, adapters={"a": 1.0}, **KW)).token_ids
    async with Session.open(str(base), n_ctx=256, adapters=_opened(ads)) as s:
        await s.generate(prompt, **KW)
        hits = s.stats()["prefix_cache_hit_tokens"]
        assert (await s.generate(prompt, adapters={"a": 1.0}, **KW)).token_ids == want
        await s.generate(prompt, adapters={"a": 0.5}, **KW)
        assert s.stats()["prefix_cache_hit_tokens"] == hits
        assert (await s.generate(prompt, adapters={"a": 1.0}, **KW)).token_ids == want
        assert s.stats()["prefix_cache_hit_tokens"] == hits + 32


async def test_unload_while_in_use_and_load_at_run_time(qwen2):
    """An adapter unloaded while a request uses it serves that request to its end, then goes (its
    graphs and prepared weights with it); new requests naming it are refused; load_adapter brings one
    in at run time. Mutation: AdapterSet.remove dropping it from `live` at once fails the first check
    (the running request loses it: other tokens)."""
    base, ads = qwen2
    async with Session.open(str(base), n_ctx=256) as s:
        want = (await s.generate(PROMPTS[0], **dict(KW, max_tokens=40))).token_ids  # the base
        await s.load_adapter("a", ads["a"])
        assert s.adapters == {"a": str(ads["a"])}
        with_a = (await s.generate(PROMPTS[0], adapters={"a": 1.0}, **dict(KW, max_tokens=40))).token_ids
        assert with_a != want
        key, got, held = s.model.adapters.names["a"], [], None
        async for c in s.stream(PROMPTS[0], adapters={"a": 1.0}, **dict(KW, max_tokens=40)):
            if held is None:  # the request runs: unloaded under it
                s.unload_adapter("a")
                assert s.adapters == {}
                held = key in s.model.adapters.live
            got += c.token_ids
        assert held and got == with_a and c.finish_reason == "length"
        assert s.model.adapters.live == {}
        with pytest.raises(InvalidRequestError, match="'a'"):
            await s.generate(PROMPTS[0], adapters={"a": 1.0}, **KW)
        assert (await s.generate(PROMPTS[0], **dict(KW, max_tokens=40))).token_ids == want
        graphs = s.engine.runner.graphs
        assert not any(sig.shape.lora for sig in graphs._graphs)
        assert not any("@a#" in n for st in graphs.stores.values() for n in st._prepared)


async def test_bad_adapters_are_refused_by_name_and_the_session_serves_on(qwen2, tmp_path):
    """A missing file, a model that is no adapter, another architecture's adapter, one whose shapes
    lie, an unknown name in a request, a bad scale: errors that name the problem; the session then
    serves as before. Mutation: load_adapter skipping the shape check fails the lying file's case."""
    base, ads = qwen2
    deeper = write_lora(tmp_path / "deeper.gguf", write(tmp_path / "q3.gguf", ("qwen2", {"block_count": 3}, {})), seed=3)
    lying = write_lora(tmp_path / "lying.gguf", base, seed=3, shapes={"blk.1.ffn_up.weight.lora_b": (48, 8)})
    foreign = write_lora(tmp_path / "foreign.gguf", base, seed=3, arch="llama")
    async with Session.open(str(base), n_ctx=256) as s:
        want = (await s.generate(PROMPTS[0], **KW)).token_ids
        with pytest.raises(ModelNotFoundError, match="no such file"):
            await s.load_adapter("x", tmp_path / "missing.gguf")
        with pytest.raises(ModelLoadError, match="not a LoRA adapter"):
            await s.load_adapter("x", base)
        with pytest.raises(ModelLoadError, match="for 'llama'; the model is 'qwen2'"):
            await s.load_adapter("x", foreign)
        with pytest.raises(ModelLoadError, match=r"'blk\.2\.attn_k\.weight' does not exist in the base model"):
            await s.load_adapter("x", deeper)  # a qwen2 of 3 layers' adapter
        with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight' has shapes lora_a \(4, 64\), lora_b \(48, 8\)"):
            await s.load_adapter("x", lying)
        await s.load_adapter("a", ads["a"])
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
            await s.generate(PROMPTS[0], adapters={"nope": 1.0}, **KW)
        with pytest.raises(InvalidRequestError, match="scale"):
            await s.generate(PROMPTS[0], adapters={"a": float("nan")}, **KW)
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'"):
            s.unload_adapter("nope")
        assert s.adapters == {"a": str(ads["a"])}
        assert (await s.generate(PROMPTS[0], **KW)).token_ids == want


def _values(w) -> np.ndarray:
    """A loaded adapter matrix's values (F16 or F32 record) as float32, in the GGUF's order."""
    v = np.frombuffer(w.raw.tobytes(), np.float16 if w.ggml_type == T.F16 else np.float32).reshape(w.shape)
    return v.astype(np.float32) if w.name.split("@")[0].endswith("lora_a") else v.T.astype(np.float32)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0])
def test_adapter_weight_types(qwen2, tmp_path, qtype):
    """F16, BF16 and Q8_0 adapters load as the values the file holds (gguf.quants' dequantization),
    F16 kept at 2 bytes a weight, the others widened to float32. Mutation: the F16 path reading its
    bits as BF16 (quants.dequantize(raw, BF16)) fails F16."""
    base, _ = qwen2
    path = write_lora(tmp_path / "q.gguf", base, seed=5, rank=32, qtype=qtype)
    ref = write_lora(tmp_path / "f.gguf", base, seed=5, rank=32)
    m = load_model(base)
    try:
        got, f32 = load_adapter(path, "q", m), load_adapter(ref, "f", m)
        for name, (a, b) in f32.pairs.items():
            for q, w in zip(got.pairs[name], (a, b)):
                want = gguf.quants.dequantize(gguf.quants.quantize(_values(w), qtype), qtype)
                assert np.array_equal(_values(q), want), q.name
        assert got.nbytes * (2 if qtype == T.F16 else 1) == f32.nbytes
    finally:
        m.close()


@pytest.mark.parametrize("half", [False, True])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(monkeypatch, half):
    """The cpu kernel at Qwen2.5-0.5B's shapes (896 -> 4864, rank 16): a row alone (the one-thread
    kernel, as a decoding stream) and among 17 rows using other adapters or none (the threaded one,
    as a step of many streams, an adapter's rows sharing its widened weights), one adapter per node and
    two, with rows that use both (the threads split the rows) and without (they split the adapters):
    bitwise the same. Mutations: the shared-weights path's x a products times 1.0000001 (a last-bit
    change there only) fails it; so does the split by adapter starting each thread one adapter later."""
    from hearthlm.backends.cpu import lora as cpu_lora
    from hearthlm.core.graph import Graph
    rng = np.random.default_rng(0)
    dt = np.float16 if half else np.float32
    a = [(rng.standard_normal((16, 896)) / 30).astype(dt) for _ in range(2)]
    b = [(rng.standard_normal((16, 4864)) / 4).astype(dt) for _ in range(2)]
    x, y = rng.standard_normal((17, 896)).astype(np.float32), rng.standard_normal((17, 4864)).astype(np.float32)
    s2 = np.zeros((17, 3), np.float32)
    s2[::2, 0], s2[1::3, 2], s2[5, 0], s2[5, 2] = 1.0, 0.5, 2.0, 1.5
    s1 = s2.copy()
    s1[s1[:, 0] != 0, 2] = 0  # no row with two adapters: the threads split the adapters, not the rows
    for n_ad, s in ((1, s2), (2, s2), (2, s1)):
        g = Graph()
        pairs = [(g.weight(_f32_weight(f"a{i}{half}", a[i])), g.weight(_f32_weight(f"b{i}{half}", b[i]))) for i in range(n_ad)]
        node = g.lora(g.input("y", y.shape, np.float32), g.input("x", x.shape, np.float32), g.input("s", s.shape, np.float32),
                      pairs, cols=(0, 2)[:n_ad], alphas=(32.0, 0.0)[:n_ad], name="y_lora")
        ab = [m for i in range(n_ad) for m in (a[i], b[i])]
        ab = [m.view(np.uint16) if half else m for m in ab]
        monkeypatch.setattr(cpu_lora, "PAR_MIN_MACS", 1)
        batch = cpu_lora.lora(node, y, x, s, *ab)
        for t in (0, 5, 7, 16):  # 7: the second adapter's alone
            monkeypatch.setattr(cpu_lora, "PAR_MIN_MACS", 1 << 60)
            alone = cpu_lora.lora(node, y[t:t + 1], x[t:t + 1], s[t:t + 1], *ab)
            assert np.array_equal(alone[0], batch[t]), (n_ad, t)
        assert np.array_equal(batch[3], y[3]) and not np.array_equal(batch[0], y[0])  # row 3: no adapter


def _f32_weight(name, m):
    from hearthlm.core.weights import QWeight
    t = T.F16 if m.dtype == np.float16 else T.F32
    return QWeight(name, int(t), m.shape, np.ascontiguousarray(m).view(np.uint8).reshape(m.shape[0], -1))


@pytest.mark.parametrize("kind", ["mm", "stack", "add", "ffn"])
def test_fused_rows_do_not_depend_on_the_batch(kind):
    """A projection with its adapters in one node (MUL_MAT_LORA, stacked q/k/v, MUL_MAT_ADD_LORA, FFN_GLU_LORA)
    at Qwen2.5-0.5B's shapes, Q8_0 weights and rank-16 F16 adapters: a row alone (the one-token call, the
    adapter's products on the threads) and among 9 rows using two adapters (the batched kernels): bitwise the
    same, at 2 threads and 1. Mutations: the x a products of _three_par's first part times 1.0000001 fails
    all four; the stacked call taking the third part's a for the first fails "stack"."""
    import numba
    from gguf.constants import GGMLQuantizationType as T

    from hearthlm.core.graph import Graph
    from hearthlm.core.weights import QWeight
    rng = np.random.default_rng(1)
    be = get_backend("cpu")
    n_in, outs = (4864, (896,)) if kind == "add" else (896, {"mm": (4864,), "stack": (896, 128, 128), "ffn": (4864, 4864)}[kind])
    qw = [QWeight(f"w{kind}{j}", int(T.Q8_0), (o, n_in), gguf.quants.quantize(rng.standard_normal((o, n_in)).astype(np.float32) / 30,
                                                                             T.Q8_0)) for j, o in enumerate(outs)]
    if kind == "stack":
        from hearthlm.core.weights import stacked_weight
        qw = [stacked_weight(qw)]
    ads = [[(QWeight(f"a{kind}{j}{i}", int(T.F16), (16, n_in), (rng.standard_normal((16, n_in)) / 30).astype(np.float16)
                     .view(np.uint8).reshape(16, -1)),
             QWeight(f"b{kind}{j}{i}", int(T.F16), (16, o), (rng.standard_normal((16, o)) / 4).astype(np.float16)
                     .view(np.uint8).reshape(16, -1))) for i in range(2)] for j, o in enumerate(outs)]
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    r = rng.standard_normal((9, outs[0])).astype(np.float32)
    s = np.zeros((9, 2), np.float32)
    s[::2, 0], s[1::2, 1] = 1.0, 0.5
    prep = {id(w): be.prepare_weight(w) for w in [*qw, *(m for part in ads for p in part for m in p)]}

    def run(rows):
        g = Graph()
        xi, si = g.input("x", (len(rows), n_in), np.float32), g.input("s", (len(rows), 2), np.float32)
        parts = [([(g.weight(a), g.weight(b)) for a, b in part], (0, 1), (32.0, 0.0)) for part in ads]
        ws = [g.weight(w) for w in qw]
        if kind == "ffn":
            node = g.proj_lora(Op.FFN_GLU_LORA, (*ws, xi), si, parts, "f", act="silu")
        elif kind == "add":
            node = g.proj_lora(Op.MUL_MAT_ADD_LORA, (ws[0], xi, g.input("r", (len(rows), outs[0]), np.float32)), si, parts, "y")
        else:
            ends = np.cumsum((0, *outs))
            node = g.proj_lora(Op.MUL_MAT_LORA, (ws[0], xi), si, parts, "y",
                               **({"out_cols": tuple((int(a), int(b)) for a, b in zip(ends[:-1], ends[1:]))} if kind == "stack" else {}))
        feed = {"x": x[rows], "s": s[rows], "r": r[rows]}
        vals = [feed[t.name].copy() if t.op is Op.INPUT else prep[id(t.params["weight"])] for t in node.srcs]
        return be.bind(node)(*vals)
    batch = run(list(range(9)))
    for threads in (2, 1):
        numba.set_num_threads(threads)
        try:
            for t in (0, 3, 8):
                assert np.array_equal(run([t])[0], batch[t]), (kind, threads, t)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
