"""`hearthlm bench --image --streams N`: what a client sending images back to back costs decoding
streams beside it (#39: encoding takes its share of each engine step). N streams decode
--decode-tokens each on the text model alone, then again while another client sends a new image
(no cache serves it) after each answer; printed: the streams' tokens/s in both, the ratio, and the
worst gap between a stream's consecutive tokens."""
from __future__ import annotations

import os
import sys
import time

import anyio
import numpy as np

from hearthlm.bench import session_options
from hearthlm.bench.vision import N_CTX, PROMPT, _image, _mmproj, _text_model, host_line

STREAM_PROMPT = "Tell a long story about a lighthouse keeper, number {i}."


async def _stream(s, i: int, n_tokens: int, times: list[float]) -> None:
    """One decoding stream: each chunk's arrival time, once per token it carries."""
    async for ch in s.stream(STREAM_PROMPT.format(i=i), max_tokens=n_tokens, temperature=0, ignore_eos=True):
        times += [time.perf_counter()] * len(ch.token_ids)


def _summary(streams: list[list[float]]) -> dict:
    """Tokens/s of all streams from the first one's first token to the last one's last (prefills
    apart), and the longest wait between two tokens of one stream."""
    t0, t1 = min(t[0] for t in streams), max(t[-1] for t in streams)
    n = sum(len(t) - 1 for t in streams)
    gaps = [float(np.max(np.diff(t))) for t in streams if len(t) > 1]
    return dict(tok_s=n / (t1 - t0) if t1 > t0 else 0.0, worst_gap_s=max(gaps, default=0.0), tokens=n)


async def _round(s, n_streams: int, n_tokens: int, images: list | None) -> dict:
    """N streams to their end; with `images`, a client sending them one after another meanwhile
    ("describe this image", one token each) until the streams are done."""
    streams: list[list[float]] = [[] for _ in range(n_streams)]
    sent = [0]

    async def client() -> None:
        for rgb in images:
            await s.generate(PROMPT, images=[rgb], max_tokens=1, temperature=0)
            sent[0] += 1
        raise RuntimeError(f"all {len(images)} images were answered before the streams ended: give more")

    before = s.stats()
    async with anyio.create_task_group() as outer:
        if images:
            outer.start_soon(client)
        async with anyio.create_task_group() as tg:
            for i in range(n_streams):
                tg.start_soon(_stream, s, i, n_tokens, streams[i])
        outer.cancel_scope.cancel()
    out = _summary(streams)
    after = s.stats()
    out.update(images_answered=sent[0], images_encoded=after.get("images_encoded", 0) - before.get("images_encoded", 0),
               encode_s=after.get("image_encode_time_s", 0.0) - before.get("image_encode_time_s", 0.0))
    return out


def bench_streams(a) -> dict:
    """Alone, then beside back-to-back images: each phase's summary, their ratio, the host's load."""
    if "numba" not in sys.modules:  # the engine's threads (read once, at numba's import)
        os.environ["NUMBA_NUM_THREADS"] = str(a.threads or 2)
    from hearthlm.session import Session
    text = _text_model(a)
    mmproj = _mmproj(a, text)
    n, n_tokens = a.streams, a.decode_tokens
    facts = dict(text_model=text, mmproj=mmproj, streams=n, decode_tokens=n_tokens, threads=a.threads or 2,
                 host_before=host_line())

    async def main() -> None:
        opts = session_options(a, mmproj=mmproj, n_ctx=N_CTX, backend="cpu")
        async with Session.open(text, options=opts) as s:
            size = s.engine.runner.vision.tower.config.image_size
            await s.generate(PROMPT, images=[_image(size, 10_000)], max_tokens=1, temperature=0)  # warm-up: graphs
            await _round(s, n, 4, None)
            facts["image_size"] = size
            facts["alone"] = await _round(s, n, n_tokens, None)
            facts["beside"] = await _round(s, n, n_tokens, [_image(size, seed) for seed in range(1000)])
            facts["alone_after"] = await _round(s, n, n_tokens, None)  # the machine's drift between the two
            facts["longest_turn_s"] = s.stats().get("image_longest_turn_s")  # the tower's longest turn beside decoding
    anyio.run(main)
    facts["ratio"] = facts["beside"]["tok_s"] / facts["alone"]["tok_s"]
    facts["host_after"] = host_line()
    return facts


def print_streams(f: dict) -> None:
    print(f"text model: {f['text_model'].rsplit('/', 1)[-1]}  mmproj: {f['mmproj'].rsplit('/', 1)[-1]}  image: "
          f"{f['image_size']}x{f['image_size']}  streams: {f['streams']} x {f['decode_tokens']} tokens  "
          f"threads: {f['threads']}")
    print(f["host_before"])
    print(f"{'':22}{'tok/s':>10}{'worst gap s':>14}{'tower s':>10}{'images':>8}")
    for k, label in (("alone", "streams alone"), ("beside", "beside images"), ("alone_after", "alone again")):
        r = f[k]
        print(f"{label:22}{r['tok_s']:>10.1f}{r['worst_gap_s']:>14.3f}{r['encode_s']:>10.2f}{r['images_encoded']:>8}")
    print(f"ratio (beside / alone): {f['ratio']:.2f}  (tower s: the tower's time during the streams; images: those "
          "it finished)" + (f"; the tower's longest turn beside them: {f['longest_turn_s']:.3f} s"
                            if f.get("longest_turn_s") is not None else ""))
    print(f["host_after"].replace("cpu: ", "after: "))
