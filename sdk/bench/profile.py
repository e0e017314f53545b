"""`hearthlm bench --profile`: where a decode step's time goes at 1, 4, 16 and 64 tokens per
step. n requests decode together (8-token prompts, or --context N tokens: decode after a long
prompt; the steps timed are decode steps of n tokens); each step's wall time splits into kernels by op kind, the rest of the graph walk
(Python per node), and the engine around it (plan, inputs, sampling, callbacks). Per op kind also
the weight bytes its kernels read per step and the rate they read them at, against the host's
read bandwidth (backends.cpu.bandwidth): where a decode step falls short of the roofline. With
--lora-adapters N, request i uses random adapter i mod N (bench.lora's adapters): where LoRA's time goes."""
from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from pathlib import Path

import anyio

from hearthlm.bench import session_options
from hearthlm.bench.roofline import read_bytes
from hearthlm.core.graph import Op
from hearthlm.runtime import dispatch
from hearthlm.runtime import runner as runner_mod
from hearthlm.runtime.graph_cache import bucket
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.session import Session


class _Acc:
    """Per step size (tokens): kernel seconds by op, execute() seconds, steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.by_op: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.walk: dict[int, float] = defaultdict(float)   # execute() as a whole
        self.bytes: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # weight bytes read
        self.steps: dict[int, int] = defaultdict(int)
        self.cur: dict[str, float] = {}  # the running step's by_op


def _timed_execute(acc: _Acc):
    def execute(cg, feed, cache_of, keep=frozenset()):
        n = len(feed["tokens"])
        by_op = acc.by_op[n]
        cg.runner = None  # the walk is what is timed: no replay of a captured CUDA graph
        reads = _reads.get(id(cg))
        if reads is None or reads[0] is not cg:  # once per graph, outside the time: each kernel wrapped, its reads
            reads = _reads[id(cg)] = (cg, {})
            for st in cg.steps:
                if st.kind is dispatch.KERNEL and not getattr(st.fn, "_timed", False):
                    st.fn = _wrap(st.fn, acc, st.node.op.value)
                if st.kind is dispatch.KERNEL and st.node.op not in _LOOKUPS:
                    op = st.node.op.value
                    reads[1][op] = reads[1].get(op, 0) + sum(read_bytes(st.node, cg.steps[j].value) for j in st.srcs
                                                             if cg.steps[j].kind is dispatch.STATIC)
        for op, b in reads[1].items():
            acc.bytes[n][op] += b
        acc.cur = by_op
        t_walk = time.perf_counter()  # the walk itself is dispatch.execute
        outs = dispatch.execute(cg, feed, cache_of, keep)
        acc.walk[n] += time.perf_counter() - t_walk
        acc.steps[n] += 1
        return outs
    return execute


_reads: dict = {}  # id(compiled graph) -> (it, weight bytes its kernels read by op)
_LOOKUPS = {Op.GET_ROWS}  # read a few rows of their table, not all of it


def _wrap(fn, acc: _Acc, name: str):
    def k(*args, **kw):
        t = time.perf_counter()
        r = fn(*args, **kw)
        acc.cur[name] += time.perf_counter() - t
        return r
    k._timed = True
    return k


async def _run(a, levels: list[int], decode: int) -> list[dict]:
    acc = _Acc()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        files = _lora_files(a, d) if getattr(a, "lora_adapters", 0) else []
        return await _run_open(a, levels, decode, acc, rows, files)


def _lora_files(a, d: str) -> list[Path]:
    import gguf

    from hearthlm.bench.lora_files import write_lora
    from hearthlm.model_zoo.resolve import resolve_model
    base = str(resolve_model(a.model, filename=session_options(a).filename))
    qtype = getattr(gguf.GGMLQuantizationType, a.lora_type.upper())
    return [write_lora(Path(d) / f"r{i}.gguf", base, seed=i, rank=a.lora_rank, alpha=2.0 * a.lora_rank, size=0.05,
                       qtype=qtype) for i in range(a.lora_adapters)]


async def _run_open(a, levels: list[int], decode: int, acc: _Acc, rows: list, files: list) -> list[dict]:
    async with Session.open(a.model, options=session_options(a, max_batch_tokens=512, max_seqs=max(levels))) as s:
        for i, f in enumerate(files):
            await s.load_adapter(f"r{i}", f)
        eng = s.engine
        step0 = eng.step
        step_t: dict[int, float] = defaultdict(float)

        def step():  # the whole step, keyed by the tokens it computed (bucketed as the graph is)
            before = eng.counters["tokens_computed"]
            t = time.perf_counter()
            step0()
            n = eng.counters["tokens_computed"] - before
            if n:
                step_t[bucket(n, eng.max_batch_tokens)] += time.perf_counter() - t
        eng.step = step
        runner_mod.execute = _timed_execute(acc)
        n_prompt = getattr(a, "context", None) or 8
        # --sampled: SamplingParams' defaults (a seed a request)
        sampled, d = getattr(a, "sampled", False), SamplingParams()
        sampling = dict(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, min_p=d.min_p) if sampled \
            else dict(temperature=0)
        vocab = s.model.n_vocab
        try:
            for warm in (True, False):
                for n in levels:
                    async with anyio.create_task_group() as tg:
                        for i in range(n):
                            tg.start_soon(lambda i=i: s.generate([(1000 + i + 7 * j) % vocab for j in range(n_prompt)],
                                                                 max_tokens=4 if warm else decode,
                                                                 **sampling, seed=i if sampled else None, ignore_eos=True,
                                                                 adapters={f"r{i % len(files)}": 1.0} if files else None))
                if warm:
                    acc.reset()
                    step_t.clear()
        finally:
            runner_mod.execute = dispatch.execute
        for n in levels:
            k = acc.steps[n]
            if not k:
                continue
            ops = {op: t / k for op, t in acc.by_op[n].items()}
            mb = {op: b / k / 1e6 for op, b in acc.bytes[n].items() if b}
            kern = sum(ops.values())
            walk = acc.walk[n] / k
            total = step_t[n] / k
            rows.append(dict(tokens=n, steps=k, step_ms=1e3 * total, kernels_ms=1e3 * kern,
                             walk_python_ms=1e3 * (walk - kern), engine_python_ms=1e3 * (total - walk),
                             tok_s=n / total, ops={op: 1e3 * t for op, t in sorted(ops.items(), key=lambda x: -x[1])},
                             weight_mb=mb, weight_gb_s={op: mb[op] / 1e3 / ops[op] for op in mb if ops.get(op)}))
    return rows


def run_profile(a) -> list[dict]:
    levels = [int(x) for x in (a.concurrency or "1,4,16,64").split(",")]
    rows = anyio.run(_run, a, levels, min(a.decode_tokens, 48))
    from hearthlm.backends.cpu.bandwidth import read_bandwidth_apart
    bw = read_bandwidth_apart(a.threads)
    for r in rows:
        r["read_gb_s"] = bw / 1e9
        r["roofline"] = sum(r["weight_mb"].values()) * 1e6 * r["tok_s"] / r["tokens"] / bw
    return rows


def print_profile(rows: list[dict], model: str) -> None:
    print(f"model: {model}  per decode step (ms), tokens per step = concurrent requests")
    if rows:
        print(f"host read bandwidth {rows[0]['read_gb_s']:.1f} GB/s; roofline: weight bytes a step reads at that rate "
              "over the step's time")
    print(f"{'tokens':>6} {'step':>8} {'kernels':>8} {'walk py':>8} {'engine py':>9} {'tok/s':>8} {'weight MB':>9} "
          f"{'roofline':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['step_ms']:>8.2f} {r['kernels_ms']:>8.2f} {r['walk_python_ms']:>8.2f} "
              f"{r['engine_python_ms']:>9.2f} {r['tok_s']:>8.1f} {sum(r['weight_mb'].values()):>9.1f} {r['roofline']:>8.2f}")
    ops = list(dict.fromkeys(op for r in rows for op in r["ops"]))
    print("\nkernel time per step by op (ms)")
    print(f"{'op':>18} " + " ".join(f"{r['tokens']:>8}" for r in rows))
    for op in ops:
        print(f"{op:>18} " + " ".join(f"{r['ops'].get(op, 0.0):>8.2f}" for r in rows))
    print("\nweight MB read per step, and GB/s while reading them, by op")
    print(f"{'op':>18} " + " ".join(f"{str(r['tokens']) + ' MB':>8} {'GB/s':>6}" for r in rows))
    for op in ops:
        if any(op in r["weight_mb"] for r in rows):
            print(f"{op:>18} " + " ".join(f"{r['weight_mb'].get(op, 0.0):>8.1f} {r['weight_gb_s'].get(op, 0.0):>6.1f}"
                                          for r in rows))
