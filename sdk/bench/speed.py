"""`hearthlm bench`'s throughput: prefill tokens/s (a 512-token prompt), decode tokens/s, load time,
time to first token and peak RSS, single stream, and decode as a fraction of the memory
roofline (hearthlm.bench.roofline: bytes read per token over the host's measured read bandwidth); `--compare-llama-cpp` runs the same work
through llama-cpp-python (never a dependency) in the interpreter --llama-cpp-python names, as a child
process (hearthlm.bench.yardstick, llama_cpp_side.py), in rounds taken in turn
with hearthlm's, each figure the median of --repeat rounds. Each engine first runs
a prompt of the same length with other tokens, as llama-bench warms up: the figures are steady
state (hearthlm's first prompt of a new length also builds that shape's graph and loads its
kernels from numba's cache, about 0.3 s once per process). Also: concurrent streams
(--concurrency), constrained against free decoding (--json-schema), and each beside N
CPU-bound processes (--competing-load)."""
from __future__ import annotations

import json
import multiprocessing
import resource
import sys
import time
from contextlib import AsyncExitStack

import anyio
import numpy as np

from hearthlm.bench import kv_types, session_options
from hearthlm.bench.roofline import gguf_bytes_per_token, hearthlm_bytes_per_token
from hearthlm.bench.yardstick import NO_INTERPRETER, LlamaCppSide, interpreter
from hearthlm.model_zoo.resolve import resolve_model
from hearthlm.session import Session


def _peak_rss_mb() -> float:
    try:  # VmHWM starts afresh at exec; ru_maxrss carries the parent's peak over fork+exec
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    # ordinary (non-special) ids, fixed so every run and llama.cpp see the same prompt
    return [int(t) for t in np.random.default_rng(seed).integers(1000, min(n_vocab, 30000), n)]


def _decode_prompt(n_vocab: int, a, rep: int) -> list[int]:
    """The decode rounds' prompt: --context tokens, none shared with the other rounds' prompts."""
    return _prompt(n_vocab, a.context, seed=100 + rep)


async def _hearthlm_round(s, a, rep: int) -> dict:
    prompt = _prompt(s.model.n_vocab, a.prompt_tokens, seed=10 + rep)  # shares no prefix with earlier ones
    t = time.perf_counter()
    await s.generate(prompt, max_tokens=1, temperature=0)
    prefill_s = time.perf_counter() - t
    t, first, n = time.perf_counter(), None, 0
    async for c in s.stream(_decode_prompt(s.model.n_vocab, a, rep), max_tokens=a.decode_tokens, temperature=0,
                            ignore_eos=True):
        if first is None:
            first = time.perf_counter() - t
        n += len(c.token_ids)
    decode_s = time.perf_counter() - t - first
    return dict(prefill_tok_s=a.prompt_tokens / prefill_s, ttft_s=first,
                decode_tok_s=(n - 1) / decode_s if n > 1 else 0.0)


def _llama_cpp_round(side, a, rep: int, n_vocab: int) -> dict:
    return side.ask("round", prompt=_prompt(n_vocab, a.prompt_tokens, seed=10 + rep),
                    decode_prompt=_decode_prompt(n_vocab, a, rep), decode_tokens=a.decode_tokens)


def _threads(a) -> int:
    import os
    return a.threads or len(os.sched_getaffinity(0))


def _median_row(engine: str, backend: str, load_s: float, rounds: list[dict]) -> dict:
    keys = ("ttft_s", "prefill_tok_s", "decode_tok_s")
    return dict(engine=engine, backend=backend, load_s=load_s,
                **{k: float(np.median([r[k] for r in rounds])) for k in keys},
                peak_rss_mb=rounds[-1].get("peak_rss_mb", 0.0))


async def _bench_single(a, side, path: str, report=None) -> list[dict]:
    """Rounds of (hearthlm, llama.cpp) in turn, so that a noisy spell of a shared machine hits
    both; each figure is the median over the rounds. Several --kv-cache-type: a session each,
    open side by side, their rounds taken in turn too (the first of them also paired with llama.cpp)."""
    kvs = kv_types(a)
    backend = session_options(a).backend
    async with AsyncExitStack() as stack:
        sessions, loads = [], []
        for kv in kvs:
            t0 = time.perf_counter()
            sessions.append(await stack.enter_async_context(Session.open(
                a.model, options=session_options(a, kv, max_batch_tokens=max(512, a.prompt_tokens)))))
            loads.append(time.perf_counter() - t0)
        s = sessions[0]
        for x in sessions:
            await x.generate(_prompt(x.model.n_vocab, a.prompt_tokens, seed=1), max_tokens=2, temperature=0)  # warm-up
        ours, ref, ref_load = [[] for _ in kvs], [], None
        if side is not None:
            ref_load = side.ask("load", path=path, n_ctx=session_options(a).n_ctx, threads=_threads(a), n_batch=512)
            side.ask("eval", ids=_prompt(s.model.n_vocab, a.prompt_tokens, seed=1))  # warm-up
        bws = []  # read bandwidth, measured each round: a shared machine's load varies
        for rep in range(a.repeat):
            if backend == "cpu":
                from hearthlm.backends.cpu.bandwidth import read_bandwidth_apart
                bws.append(read_bandwidth_apart(a.threads))
            for i in range(len(kvs)):  # which type goes first turns with the rounds
                j = (i + rep) % len(kvs)
                ours[j].append(await _hearthlm_round(sessions[j], a, rep))
            if side is not None:
                ref.append(await anyio.to_thread.run_sync(lambda: _llama_cpp_round(side, a, rep, s.model.n_vocab)))
        ctx = a.context + a.decode_tokens / 2  # the decode rounds' mean context
        bpt = [hearthlm_bytes_per_token(x, ctx) for x in sessions]
        bpt.insert(1, gguf_bytes_per_token(s, ctx))
        kv_bytes = [x.stats()["kv_bytes_per_token"] for x in sessions]
    bw = float(np.median(bws)) if bws else None
    rows = [_median_row("hearthlm", backend, load_s, r) for load_s, r in zip(loads, ours)]
    for r in rows:
        r["peak_rss_mb"] = _peak_rss_mb()
    if ref:
        rows.insert(1, _median_row("llama.cpp", "cpu", ref_load["load_s"], ref))
    for r, b in zip(rows, bpt):  # decode as a fraction of what the read bandwidth allows
        r["mb_per_token"] = b / 1e6
        if bw:
            r["roofline"] = r["decode_tok_s"] * b / bw
    if bw and report is not None:  # the report's header names it
        report.facts.update(read_bandwidth_gb_s=bw / 1e9, bandwidth_threads=a.threads or "all")
    if ref:
        rows.insert(2, dict(engine="ratio", backend="", **{
            k: rows[0][k] / rows[1][k] for k in ("prefill_tok_s", "decode_tok_s")}))
    if len(kvs) > 1:  # each type's row named by it, then each against the first
        ours_rows = [r for r in rows if r["engine"] == "hearthlm"]
        for r, kv, kb in zip(ours_rows, kvs, kv_bytes):
            r.update(engine=f"hearthlm {kv}", kv_bytes_per_token=kb)
        rows += [dict(engine=f"{kv}/{kvs[0]}", backend="", **{
            k: r[k] / ours_rows[0][k] for k in ("prefill_tok_s", "decode_tok_s", "kv_bytes_per_token")})
            for kv, r in zip(kvs[1:], ours_rows[1:])]
    return rows


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _concurrent_prompt(n_vocab: int, i: int) -> list[int]:
    # distinct prompts (no prefix sharing), 64 tokens each, as a chat app's turns
    return _prompt(n_vocab, 64 + i)[i:]


def _row(n: int, wall: float, counts, ttft, itl, engine: str) -> dict:
    return dict(engine=engine, concurrency=n, aggregate_tok_s=sum(counts) / wall, ttft_p50_s=_pct(ttft, 50),
                ttft_p99_s=_pct(ttft, 99), itl_p50_ms=_pct(itl, 50) * 1e3, itl_p99_ms=_pct(itl, 99) * 1e3,
                tokens=sum(counts))


def _concurrency_llama_cpp(side, a, levels: list[int], n_vocab: int) -> list[dict]:
    """llama-cpp-python serves one request at a time: n requests arriving together are
    prefilled and decoded in turn; time to first token counts the wait for those before."""
    rows = []
    for n in levels:
        r = side.ask("serial", prompts=[_concurrent_prompt(n_vocab, i) for i in range(n)], decode_tokens=a.decode_tokens)
        rows.append(_row(n, r["wall_s"], r["counts"], r["ttft_s"], r["itl_s"], "llama.cpp"))
    return rows


def _median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Per level, each figure's median over the rounds (a round: one row per level)."""
    out = []
    for rows in zip(*rounds):
        row = dict(rows[0])
        for k, v in row.items():
            if isinstance(v, float) and k != "concurrency":
                row[k] = float(np.median([r[k] for r in rows]))
        out.append(dict(row, rounds=len(rows)))
    return out


async def _bench_concurrency(a, side=None, path: str = "") -> list[dict]:
    """--repeat rounds, each hearthlm's levels then (with `side`) llama.cpp's, so that a noisy
    spell of a shared machine hits both: each level's figures are medians over the rounds, and
    its ratio the median of the rounds' ratios (one round's llama.cpp serial rate read 55 tok/s at
    one level and 44 at the next on a noisy VM: a ratio is only as good as its pairing)."""
    levels = [int(x) for x in a.concurrency.split(",")]
    ours, ref = [], []
    # KV for every stream's prompt and output at once (the default, 4 x n_ctx, would preempt at 64)
    kv = max(levels) * (64 + max(levels) + a.decode_tokens + 16)
    o = session_options(a, max_batch_tokens=512, max_seqs=max(levels))
    async with Session.open(a.model, options=session_options(a, max_batch_tokens=512, max_seqs=max(levels),
                                                             kv_cache_tokens=max(kv, 4 * o.n_ctx))) as s:
        await s.generate([1000, 1001, 1002], max_tokens=2, temperature=0)  # warm the JIT caches
        n_vocab = s.model.n_vocab
        if side is not None:
            side.ask("load", path=path, n_ctx=session_options(a).n_ctx, threads=_threads(a), n_batch=512)
        for _ in range(max(a.repeat, 1)):
            ours.append([await _hearthlm_level(s, a, n) for n in levels])
            if side is not None:  # the engine is idle: nothing of hearthlm's runs beside it
                ref.append(_concurrency_llama_cpp(side, a, levels, n_vocab))
    rows = _median_rows(ours)
    if ref:
        rows += _median_rows(ref)
        rows += [dict(engine="ratio", concurrency=n, rounds=len(ref), **{
            k: float(np.median([h[i][k] / r[i][k] for h, r in zip(ours, ref)])) for k in ("aggregate_tok_s", "ttft_p50_s")})
            for i, n in enumerate(levels)]
    return rows


async def _hearthlm_level(s, a, n: int) -> dict:
    """n streams at once, each a distinct 64-token prompt and decode_tokens greedy tokens."""
    ttft, itl, counts = [], [], []
    preempted = s.stats()["preemptions"]

    async def one(i: int) -> None:
        prompt = _concurrent_prompt(s.model.n_vocab, i)
        t0 = last = anyio.current_time()
        k = 0
        async for c in s.stream(prompt, max_tokens=a.decode_tokens, temperature=0, ignore_eos=True):
            now = anyio.current_time()
            if k == 0:
                ttft.append(now - t0)
            else:
                itl.append((now - last) / max(len(c.token_ids), 1))
            last, k = now, k + len(c.token_ids)
        counts.append(k)
    t = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    wall = anyio.current_time() - t
    return dict(_row(n, wall, counts, ttft, itl, "hearthlm"), preemptions=s.stats()["preemptions"] - preempted)


async def bench_json_schema(a) -> list[dict]:
    """Rounds of unconstrained and constrained runs in turn (alternating which goes first) at
    each level; each figure the median. Both generate from the same kind of chat prompt with
    the same max_tokens; the constrained tokens include those the grammar forced."""
    with open(a.json_schema) as f:
        rf = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.load(f)}}
    levels = [int(x) for x in (a.concurrency or "1,16").split(",")]
    rows = []
    async with Session.open(a.model, options=session_options(a, max_batch_tokens=512, max_seqs=max(levels))) as s:

        async def run(n: int, constrained: bool, tag: str, max_tokens: int) -> tuple[float, int]:
            counts = []

            async def one(i: int) -> None:
                msgs = [{"role": "user", "content": f"Request {tag}-{i}: reply with JSON data for a test."}]
                c = await s.generate(messages=msgs, max_tokens=max_tokens, temperature=0.7, seed=i,
                                     response_format=rf if constrained else None, ignore_eos=not constrained)
                counts.append(len(c.token_ids))
            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
            return time.perf_counter() - t, sum(counts)
        for n in levels:  # warm-up: graph shapes, the vocabulary, the mask worker
            await run(n, False, "w", 4)
            await run(n, True, "w", 4)
        for n in levels:
            plain, cons, mask_ms = [], [], []
            for r in range(a.repeat):
                for constrained in ((False, True) if r % 2 == 0 else (True, False)):  # no order bias
                    wall, k = await run(n, constrained, f"{constrained}{r}", a.decode_tokens)
                    (cons if constrained else plain).append((k / wall, k / n))
                after = s.stats()
                mask_ms.append(after["mask_ms_per_token"])
            p, c = np.median(plain, axis=0), np.median(cons, axis=0)
            rows.append(dict(concurrency=n, plain_tok_s=float(p[0]), constrained_tok_s=float(c[0]),
                             ratio=float(c[0] / p[0]), plain_tokens_per_req=float(p[1]),
                             constrained_tokens_per_req=float(c[1]), mask_ms_per_token=float(np.median(mask_ms)),
                             mask_wait_ms_per_token=after["mask_wait_ms_per_token"]))
            print(f"concurrency {n}: ratio {rows[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
    return rows


def _spin(nice: int) -> None:
    import os
    os.nice(nice)
    while True:
        pass


class competitors:
    """N CPU-bound processes at nice K while the block runs."""

    def __init__(self, n: int, nice: int) -> None:
        self.n, self.nice, self.procs = n, nice, []

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, args=(self.nice,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)  # started and spinning
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()


_RATE_KEYS = ("prefill_tok_s", "decode_tok_s", "aggregate_tok_s")


def with_load(a, measure) -> list[dict]:
    """measure() quiet, then beside the competitors; the loaded rows, and per engine a "kept"
    row: loaded rate / quiet rate."""
    quiet = [r for r in measure() if r["engine"] != "ratio"]
    with competitors(a.competing_load, a.competing_nice):
        loaded = measure()
    kept = []
    for q, ld in zip(quiet, [r for r in loaded if r["engine"] != "ratio"]):
        kept.append(dict(ld, engine=f"{ld['engine']} kept", **{k: ld[k] / q[k] for k in _RATE_KEYS if k in ld and q.get(k)}))
    tag = f"+{a.competing_load}@nice{a.competing_nice}"
    return ([dict(r, engine=f"{r['engine']} quiet") for r in quiet]
            + [dict(r, engine=f"{r['engine']} {tag}") if r["engine"] != "ratio" else r for r in loaded] + kept)


def concurrency_rows(a, report=None) -> list[dict]:
    py = interpreter(a) if a.compare_llama_cpp else None
    if a.compare_llama_cpp and py is None:
        print(NO_INTERPRETER, file=sys.stderr)
    if not py:
        return anyio.run(_bench_concurrency, a)
    with LlamaCppSide(py) as side:
        if report is not None:
            report.build = side.build
        return anyio.run(_bench_concurrency, a, side, str(resolve_model(a.model, filename=session_options(a).filename)))


def single_rows(a, report=None) -> list[dict]:
    py = interpreter(a) if a.compare_llama_cpp else None
    if a.compare_llama_cpp and py is None:
        print(NO_INTERPRETER, file=sys.stderr)
    if not py:
        return anyio.run(_bench_single, a, None, "", report)
    # llama.cpp in its own process (that interpreter's build): its own peak RSS, no numba threads beside it
    with LlamaCppSide(py) as side:
        if report is not None:
            report.build = side.build
        return anyio.run(_bench_single, a, side, str(resolve_model(a.model, filename=session_options(a).filename)),
                         report)
