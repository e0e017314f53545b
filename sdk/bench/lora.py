"""`hearthlm bench --lora-adapters N`: decoding with LoRA adapters chosen per request against the
base model alone, same session, same prompts: at each --concurrency level, n streams where stream i
uses adapter i mod N (random rank --lora-rank adapters on every attention and FFN projection, at
the model's own shapes: lora_files.write_lora), rounds of base and adapters in turn (alternating
which goes first), each figure the median: the whole requests' rate (prefill too), and decoding's
alone (the tokens after every stream's first); and the memory each loaded adapter takes. Every run's
prompts are new (no run reuses another's prefix: each prefills its prompts, where reused ones made
a run's time depend on which blocks the other runs had evicted)."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import anyio
import gguf
import numpy as np

from hearthlm.bench import session_options
from hearthlm.bench.lora_files import write_lora
from hearthlm.bench.speed import _concurrent_prompt
from hearthlm.model_zoo.resolve import resolve_model
from hearthlm.session import Session


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def bench_lora(a) -> tuple[list[dict], dict]:
    levels = [int(x) for x in (a.concurrency or "1,16").split(",")]
    path = str(resolve_model(a.model, filename=session_options(a).filename))
    n_ad = a.lora_adapters
    kv = max(levels) * (64 + max(levels) + a.decode_tokens + 16)
    with tempfile.TemporaryDirectory() as d:
        qtype = getattr(gguf.GGMLQuantizationType, a.lora_type.upper())
        files = [write_lora(Path(d) / f"r{i}.gguf", path, seed=i, rank=a.lora_rank, alpha=2.0 * a.lora_rank, size=0.05,
                            qtype=qtype) for i in range(n_ad)]
        opts = session_options(a, max_batch_tokens=512, max_seqs=max(levels), kv_cache_tokens=max(kv, 4096))
        async with Session.open(path, options=opts) as s:
            await s.generate([1000, 1001, 1002], max_tokens=2, temperature=0)
            rss0 = _rss_mb()
            for i, f in enumerate(files):
                await s.load_adapter(f"r{i}", f)
            rss1 = _rss_mb()

            async def run(n: int, lora: bool, max_tokens: int, rnd: int) -> tuple[float, float]:
                """(tokens a second from the requests' start to the last token, and decoding's: the tokens
                after the last stream's first, over the time from it)."""
                times: list[list[float]] = []

                async def one(i: int) -> None:
                    ts = []
                    async for c in s.stream(_concurrent_prompt(s.model.n_vocab, i + max(levels) * (2 * rnd + lora)),
                                            max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                            adapters={f"r{i % n_ad}": 1.0} if lora else None):
                        ts += [time.perf_counter()] * len(c.token_ids)
                    times.append(ts)
                t = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
                end, first = time.perf_counter(), max(ts[0] for ts in times)
                after = sum(x > first for ts in times for x in ts)
                return sum(map(len, times)) / (end - t), after / (end - first) if after else 0.0
            for n in levels:  # warm-up: graph shapes with and without adapters
                await run(n, False, 4, 0)
                await run(n, True, 4, 0)
            rss2 = _rss_mb()
            rows = []
            for li, n in enumerate(levels):
                base, lora = [], []
                for r in range(a.repeat):
                    for with_lora in ((False, True) if r % 2 == 0 else (True, False)):
                        (lora if with_lora else base).append(await run(n, with_lora, a.decode_tokens, 1 + li * a.repeat + r))
                (b, bd), (lo, lod) = (np.median(np.array(x), axis=0).tolist() for x in (base, lora))
                rows.append(dict(concurrency=n, adapters=min(n, n_ad), base_tok_s=b, lora_tok_s=lo, ratio=lo / b,
                                 base_decode_tok_s=bd, lora_decode_tok_s=lod, decode_ratio=lod / bd if bd else 0.0))
                print(f"concurrency {n}: ratio {lo / b:.3f}, decoding {rows[-1]['decode_ratio']:.3f}", file=sys.stderr,
                      flush=True)
            nbytes = [ad.nbytes for ad in s.model.adapters.live.values()]
    facts = dict(adapter_mb=float(np.mean(nbytes)) / 2**20, rss_per_adapter_loaded_mb=(rss1 - rss0) / n_ad,
                 rss_per_adapter_after_use_mb=(rss2 - rss0) / n_ad, rank=a.lora_rank, type=a.lora_type, load_avg=_load())
    return rows, facts


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
