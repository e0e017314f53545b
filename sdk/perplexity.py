"""`hearthlm perplexity FILE --model M`: llama-perplexity's method, so that the figures compare
with llama.cpp's. The text is tokenized once (BOS first where the model adds one); each chunk of
n_ctx tokens is evaluated alone, its first token replaced by BOS where the model adds one, and
the second half of it scored (the tokens after position n_ctx/2, each given all before it)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import anyio
import numpy as np

from hearthlm.core.errors import InvalidRequestError
from hearthlm.options import from_args
from hearthlm.session import Session

PARALLEL_CHUNKS = 2  # chunks scored at once: the engine batches their steps


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-perplexity)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--json", action="store_true", help='end the output with one line {"ppl", "chunks", "tokens"}')


async def chunk_nlls(s: Session, text: str, ctx: int, chunks: int | None = None, progress=None) -> list[float]:
    """The mean negative log-likelihood of each chunk's scored tokens."""
    tok = s.model.tokenizer
    ids = tok.encode(text, add_special=True)
    if ctx < 4 or ctx > s.n_ctx:
        raise InvalidRequestError(f"--ctx must be in [4, {s.n_ctx}] (the session's context), got {ctx}")
    if len(ids) < 2 * ctx:
        raise InvalidRequestError(f"the text has {len(ids)} tokens; perplexity at ctx {ctx} needs at least {2 * ctx}")
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    first = ctx // 2
    out: list[float] = [math.nan] * n

    async def one(i: int) -> None:
        chunk = ids[i * ctx:(i + 1) * ctx]
        if tok.add_bos and tok.bos_id is not None:
            chunk = [tok.bos_id] + chunk[1:]
        lps = await s.score(chunk)  # lps[j]: token j+1 given tokens 0..j
        out[i] = float(-np.mean(lps[first:ctx - 1]))
        if progress:
            progress(i, out)

    for start in range(0, n, PARALLEL_CHUNKS):
        async with anyio.create_task_group() as tg:
            for i in range(start, min(start + PARALLEL_CHUNKS, n)):
                tg.start_soon(one, i)
    return out


def summary(nlls: list[float], ctx: int) -> dict[str, float | int]:
    """PPL and its error estimate as llama-perplexity prints them (every chunk scores as many tokens)."""
    m = ctx - 1 - ctx // 2
    nll = float(np.mean(nlls))
    ppl = math.exp(nll)
    # llama.cpp's estimate from per-token values; per-chunk means give the same mean, a coarser spread
    err = ppl * float(np.std(nlls, ddof=1)) / math.sqrt(len(nlls)) if len(nlls) > 1 else float("nan")
    return dict(ppl=ppl, ppl_error=err, chunks=len(nlls), tokens=m * len(nlls), ctx=ctx)


def run_perplexity(a: argparse.Namespace) -> None:
    text = Path(a.file).read_text(encoding="utf-8")

    async def main() -> dict:
        async with Session.open(a.model, options=from_args(a, n_ctx=a.ctx)) as s:
            t0 = time.perf_counter()

            def progress(i, nlls):
                done = [x for x in nlls if not math.isnan(x)]
                bar = "#" * (20 * len(done) // len(nlls))
                print(f"\r[{bar:<20}] {len(done)}/{len(nlls)} chunks, PPL so far {math.exp(np.mean(done)):.4f}, "
                      f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
            nlls = await chunk_nlls(s, text, a.ctx, a.chunks, progress)
            print(file=sys.stderr)
            return summary(nlls, a.ctx)
    r = anyio.run(main)
    print(f"Final estimate: PPL = {r['ppl']:.4f} +/- {r['ppl_error']:.5f} "
          f"({r['chunks']} chunks of {r['ctx']} tokens, {r['tokens']} scored)")
    if a.json:
        print(json.dumps({"ppl": r["ppl"], "chunks": r["chunks"], "tokens": r["tokens"]}))
