"""`hearthlm bench --speculative ngram` (or `draft --draft-model M`, or `mtp`): decode tokens/s with and
without prompt-lookup (or draft-model, or the model's own MTP block's) speculation, in rounds taken
in turn (each figure the median of --repeat), on chat tasks:
rewriting a 60-line Python function with one variable renamed, greedy (the output copies its
input), and a story, greedy and sampled at temperature 0.8 (it does not, but for its own
repeats). Decode rate: tokens after the first over the time
from the first to the last; the acceptance rate: draft tokens kept over drafted."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import anyio
import numpy as np

from hearthlm.bench import session_options
from hearthlm.core.errors import HearthError
from hearthlm.session import Session

FUNCTION = '''def merge_intervals(intervals, min_gap=0, label_key="name"):
    """Merge overlapping intervals, keeping the labels of the merged ones."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda item: (item["start"], item["end"]))
    merged = []
    current = dict(ordered[0])
    current["labels"] = [current.get(label_key)]
    for item in ordered[1:]:
        start, end = item["start"], item["end"]
        if start <= current["end"] + min_gap:
            if end > current["end"]:
                current["end"] = end
            current["labels"].append(item.get(label_key))
            continue
        merged.append(current)
        current = dict(item)
        current["labels"] = [item.get(label_key)]
    merged.append(current)
    for block in merged:
        block["length"] = block["end"] - block["start"]
        block["labels"] = [x for x in block["labels"] if x is not None]
        block.pop(label_key, None)
    total = sum(block["length"] for block in merged)
    if total == 0:
        return merged
    for block in merged:
        block["share"] = round(block["length"] / total, 4)
    widest = max(merged, key=lambda block: block["length"])
    widest["widest"] = True
    gaps = []
    for left, right in zip(merged, merged[1:]):
        gap = right["start"] - left["end"]
        if gap > 0:
            gaps.append({"after": left["labels"], "before": right["labels"], "gap": gap})
    if gaps:
        largest = max(gaps, key=lambda g: g["gap"])
        for block in merged:
            block["before_largest_gap"] = block["labels"] == largest["after"]
    summary = {
        "count": len(merged),
        "total": total,
        "widest": widest["labels"],
        "gaps": len(gaps),
    }
    for block in merged:
        block["summary"] = summary
    checked = []
    for block in merged:
        if block["length"] < 0:
            raise ValueError(f"negative interval: {block}")
        if block["share"] > 1:
            raise ValueError(f"share above one: {block}")
        checked.append(block)
    return checked
'''
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TASKS = {  # name: (prompt, temperature); a small model's greedy story soon repeats itself, a sampled one less
    "rename": ("Rewrite this Python function with the variable `current` renamed to `active`. "
               "Reply with the code only.\n\n" + FUNCTION, 0.0),
    "free": (STORY, 0.0),
    "free-t0.8": (STORY, 0.8),
}


async def _round(s: Session, task: tuple[str, float], spec: str | None, n: int) -> tuple[float, int, int]:
    """(decode tok/s, drafted, accepted) of one generation."""
    prompt, temperature = task
    before = s.stats()
    times = []
    async for c in s.stream(messages=[{"role": "user", "content": prompt}], max_tokens=n,
                            temperature=temperature, seed=1, speculative=spec, ignore_eos=True):
        times += [time.perf_counter()] * len(c.token_ids)
    after = s.stats()
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return (rate, after["spec_drafted_tokens"] - before["spec_drafted_tokens"],
            after["spec_accepted_tokens"] - before["spec_accepted_tokens"])


async def bench_speculative(a) -> list[dict]:
    rows = []
    o = session_options(a)
    if a.speculative == "draft" and not o.draft_model:
        raise HearthError("--speculative draft needs --draft-model")
    async with Session.open(a.model, options=replace(o, n_ctx=max(o.n_ctx, 2048))) as s:
        for name, prompt in TASKS.items():  # prompt: (text, temperature)
            await _round(s, prompt, a.speculative, 8)  # warm-up: graph shapes of both
            await _round(s, prompt, "off", 8)
            plain, spec, drafted, kept = [], [], 0, 0
            for r in range(a.repeat):
                for mode in (("off", a.speculative) if r % 2 == 0 else (a.speculative, "off")):  # no order bias
                    rate, d, k = await _round(s, prompt, mode, a.decode_tokens)
                    (plain if mode == "off" else spec).append(rate)
                    drafted, kept = drafted + d, kept + k
            rows.append(dict(task=name, plain_tok_s=float(np.median(plain)), spec_tok_s=float(np.median(spec)),
                             ratio=float(np.median(spec) / np.median(plain)), drafted=drafted, accepted=kept,
                             acceptance=kept / drafted if drafted else 0.0))
            print(f"{name}: ratio {rows[-1]['ratio']:.2f}", file=sys.stderr, flush=True)
    return rows


def run(a) -> list[dict]:
    return anyio.run(bench_speculative, a)
