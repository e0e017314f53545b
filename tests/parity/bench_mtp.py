"""MTP decode speed against plain decode, same session, rounds taken in turn (each figure the median of
--repeat): Qwen3.5-0.8B's shapes (models.BENCH's, Q4_K_M-like random weights) with its one MTP block.
Random weights draft nothing the model keeps, so the file is made to keep them: every layer's output
matrices (attn_output, ssm_out, ffn_down; the MTP block's too) are zero blocks of their type, so the
model's next token is a function of its last one (the tied head over the normed embedding: itself, a
self-copying model), and the MTP block's eh_proj passes the token half through (F16 [I | 0]), so it
predicts the same. Every matrix is still multiplied as in the real model: the cost is the real shapes',
the acceptance is made, and says nothing about acceptance on real text.
Decode rate: tokens after the first over the time from the first to the last.
  python tests/parity/bench_mtp.py [--tokens 128] [--repeat 3] [--backend cpu] [--k 3]"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import anyio
import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCH, BENCH_VOCAB, HPARAMS, _add, _Seen, _vocab, finish, q4_k_m  # noqa: E402

from hearthlm import Session  # noqa: E402
from hearthlm.backends.random_blocks import random_blocks  # noqa: E402
from hearthlm.model_zoo.models import get_architecture, qwen35_mtp  # noqa: E402
from hearthlm.model_zoo.tensors import specs as tensor_specs  # noqa: E402

ZERO = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")


def write(path: Path, seed: int = 0) -> Path:
    arch, md0, _ = BENCH["qwen35-0.8b"]
    n_vocab, rng = BENCH_VOCAB["qwen35-0.8b"], np.random.default_rng(seed)
    md = _Seen({f"{arch}.{k}": v for k, v in {**HPARAMS, **md0, "block_count": 25, "nextn_predict_layers": 1}.items()
                if v is not None})
    mod = get_architecture(arch)
    cfg = mod.Config.from_gguf(md, arch)
    head = qwen35_mtp.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, block=cfg.n_layer)
    head = dataclasses.replace(head, n_layer=1, recurrent_layers=(0,), head_count_kv_layers=(), n_nextn=0)
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in md.items():
        if k in md.seen:
            _add(w, k, v)
    _vocab(w, n_vocab)
    specs = {s.name: s for s in tensor_specs(mod, cfg, n_vocab) + tensor_specs(qwen35_mtp, head, n_vocab)}
    for n in ("enorm", "hnorm"):  # the block's input norms, applied where its input is made (runtime.draft_heads)
        specs[f"blk.{cfg.n_layer}.nextn.{n}.weight"] = dataclasses.replace(specs["output_norm.weight"],
                                                                           name=f"blk.{cfg.n_layer}.nextn.{n}.weight")
    pick = q4_k_m(cfg.n_layer)
    e = cfg.n_embd
    for s in specs.values():
        if s.optional and (s.name.endswith((".bias", "output.weight")) or "nextn.shared_head" in s.name):
            continue  # tied, no biases; the MTP block's head and norm are the model's
        if s.name.endswith("nextn.eh_proj.weight"):
            w.add_tensor(s.name, np.hstack([np.eye(e), np.zeros((e, e))]).astype(np.float16))
            continue
        bq = pick(s.name, s.shape)
        if bq is not None:
            blocks = random_blocks(bq, int(np.prod(s.shape[:-1])), s.shape[-1], rng)
            if s.name.endswith(ZERO):
                blocks[:] = 0
            w.add_tensor(s.name, blocks.reshape(*s.shape[:-1], -1), raw_dtype=bq)
        elif s.name.endswith(".ssm_a"):
            w.add_tensor(s.name, -np.exp(0.5 * rng.standard_normal(s.shape)).astype(np.float32))
        elif len(s.shape) == 1:
            w.add_tensor(s.name, np.ones(s.shape, np.float32) if "nextn" in s.name else
                         (1.0 + 0.1 * rng.standard_normal(s.shape)).astype(np.float32))
        else:
            w.add_tensor(s.name, (rng.standard_normal(s.shape) / np.sqrt(s.shape[-1])).astype(np.float32))
    return finish(w, path)


async def decode_rate(s, prompt, n, spec) -> float:
    times = []
    async for c in s.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True, speculative=spec):
        times += [time.perf_counter()] * len(c.token_ids)
    return (len(times) - 1) / (times[-1] - times[0])


async def main(a) -> None:
    path = Path(a.file)
    if not path.exists():
        write(path)
    prompt = [1 + (i * 7919) % 5000 for i in range(64)]
    async with Session.open(str(path), n_ctx=1024, backend=a.backend, draft_p_min=0.0, rollback_slots=a.k + 1) as s:
        s.engine.mtp.k_max = a.k
        await decode_rate(s, prompt, a.tokens, "off")  # compile, warm: every step shape the rounds meet
        await decode_rate(s, prompt, a.tokens, "mtp")
        plain, mtp = [], []
        for _ in range(a.repeat):
            plain.append(await decode_rate(s, prompt, a.tokens, "off"))
            mtp.append(await decode_rate(s, prompt, a.tokens, "mtp"))
        st = s.stats()
    p, m = statistics.median(plain), statistics.median(mtp)
    print(f"plain {p:.1f} tok/s, mtp {m:.1f} tok/s: {m / p:.2f}x (drafted {st['spec_drafted_tokens']}, "
          f"kept {st['spec_accepted_tokens']}); rounds plain {[round(x, 1) for x in plain]} mtp {[round(x, 1) for x in mtp]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="/tmp/qwen35-0.8b-mtp-random.gguf")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--k", type=int, default=3, help="draft tokens at most per step (runtime.draft_heads.K_MAX)")
    anyio.run(main, ap.parse_args())
