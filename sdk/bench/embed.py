"""`hearthlm bench --embed`: embedding throughput, texts/s, one text per call (batch 1) and 32
texts per call (batch 32), on the model given (an encoder, or a decoder's embeddings). With
--compare-llama-cpp, llama-cpp-python (never a dependency) embeds the same token ids in its own
process (embedding=True, the file's pooling), in rounds taken in turn with hearthlm's; each
figure is the median of --repeat rounds. Each engine first embeds the texts once (warm-up)."""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import anyio
import numpy as np

from hearthlm.bench import session_options
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


def _llama_cpp_worker(path: str, inputs, batch: int, warm: bool) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    global _LLM
    if "_LLM" not in globals():  # llama-cpp-python's defaults but for the sequences per decode
        _LLM = llama_cpp.Llama(model_path=path, embedding=True, n_ctx=2048, n_batch=512, n_ubatch=512,
                               n_seq_max=32, verbose=False)
    llm = _LLM

    def decode(seqs):
        llm._batch.reset()
        for i, ids in enumerate(seqs):
            llm._batch.add_sequence(ids, i, False)
        llm._ctx.kv_cache_clear()
        llm._ctx.decode(llm._batch)
        return [llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, i)[0] for i in range(len(seqs))]

    def embed(batch_ids):  # llama-cpp-python's embed(list), on ids: decodes of up to n_batch tokens
        out, group, n = [], [], 0
        for ids in batch_ids:
            if group and (n + len(ids) > llm.n_batch or len(group) >= 32):
                out += decode(group)
                group, n = [], 0
            group.append(ids)
            n += len(ids)
        return out + decode(group)
    if warm:
        _rate(embed, inputs, batch)
    return _rate(embed, inputs, batch)


async def _rate_async(s: Session, inputs: list[list[int]], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(inputs), batch):
        await s.embed(inputs[i:i + batch])
    return len(inputs) / (time.perf_counter() - t0)


async def _bench(path: str, a, llama_ex) -> list[dict]:
    rows = []
    async with Session.open(path, options=session_options(a)) as s:
        inputs = texts(s.model.n_vocab)
        for batch in (1, 32):
            ours, theirs = [], []
            await _rate_async(s, inputs, batch)  # warm-up: the graphs of these shapes
            for rep in range(a.repeat):
                ours.append(await _rate_async(s, inputs, batch))
                if llama_ex is not None:
                    theirs.append(await anyio.to_thread.run_sync(
                        lambda: llama_ex.submit(_llama_cpp_worker, path, inputs, batch, rep == 0).result()))
            row = dict(batch=batch, hearthlm_texts_s=float(np.median(ours)))
            if theirs and theirs[0] is not None:
                row.update(llama_cpp_texts_s=float(np.median(theirs)))
                row.update(ratio=row["hearthlm_texts_s"] / row["llama_cpp_texts_s"])
            rows.append(row)
    return rows


def bench_embed(a, path: str) -> list[dict]:
    if not a.compare_llama_cpp:
        return anyio.run(_bench, path, a, None)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return anyio.run(_bench, path, a, ex)
