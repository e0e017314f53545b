"""`hearthlm bench --embed`: embedding throughput, texts/s, one text per call (batch 1) and 32
texts per call (batch 32), on the model given (an encoder, or a decoder's embeddings). With
--compare-llama-cpp, llama-cpp-python (never a dependency) embeds the same token ids in the
interpreter --llama-cpp-python names (hearthlm.bench.yardstick's child; embedding=True, the file's
pooling), in rounds taken in turn with hearthlm's; each figure is the median of --repeat rounds.
Each engine first embeds the texts once (warm-up)."""
from __future__ import annotations

import sys
import time

import anyio
import numpy as np

from hearthlm.bench import session_options
from hearthlm.bench.yardstick import NO_INTERPRETER, LlamaCppSide, interpreter
from hearthlm.session import Session

N_TEXTS = 64  # per round: 64 single calls, or 2 calls of 32


def texts(n_vocab: int, n: int = N_TEXTS, seed: int = 0) -> list[list[int]]:
    """Inputs of 16 to 128 tokens (a sentence to a retrieval chunk), ids past the specials."""
    rng = np.random.default_rng(seed)
    lo = min(1000, n_vocab // 2)
    return [rng.integers(lo, n_vocab, int(k)).tolist() for k in rng.integers(16, 129, n)]


def _rate(embed, inputs: list[list[int]], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(inputs), batch):
        embed(inputs[i:i + batch])
    return len(inputs) / (time.perf_counter() - t0)


async def _rate_async(s: Session, inputs: list[list[int]], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(inputs), batch):
        await s.embed(inputs[i:i + batch])
    return len(inputs) / (time.perf_counter() - t0)


async def _bench(path: str, a, side) -> list[dict]:
    rows = []
    async with Session.open(path, options=session_options(a)) as s:
        inputs = texts(s.model.n_vocab)
        for batch in (1, 32):
            ours, theirs = [], []
            await _rate_async(s, inputs, batch)  # warm-up: the graphs of these shapes
            if side is not None and batch == 1:  # llama-cpp-python's defaults but for the sequences per decode
                side.ask("load", path=path, n_ctx=2048, threads=_threads(a), n_batch=512, embedding=True, n_seq_max=32)
            for rep in range(a.repeat):
                ours.append(await _rate_async(s, inputs, batch))
                if side is not None:
                    theirs.append(await anyio.to_thread.run_sync(
                        lambda: side.ask("embed", inputs=inputs, batch=batch, warm=rep == 0)["texts_s"]))
            row = dict(batch=batch, hearthlm_texts_s=float(np.median(ours)))
            if theirs:
                row.update(llama_cpp_texts_s=float(np.median(theirs)))
                row.update(ratio=row["hearthlm_texts_s"] / row["llama_cpp_texts_s"])
            rows.append(row)
    return rows


def _threads(a) -> int:
    import os
    return a.threads or len(os.sched_getaffinity(0))


def bench_embed(a, path: str, report=None) -> list[dict]:
    py = interpreter(a) if a.compare_llama_cpp else None
    if a.compare_llama_cpp and py is None:
        print(NO_INTERPRETER, file=sys.stderr)
    if not py:
        return anyio.run(_bench, path, a, None)
    with LlamaCppSide(py) as side:
        if report is not None:
            report.build = side.build
        return anyio.run(_bench, path, a, side)
