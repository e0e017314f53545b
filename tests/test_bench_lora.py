"""`hearthlm bench --lora-adapters N` (issue #42's speed figures): base and adapter runs in turn at each
concurrency, each run on prompts of its own."""
from __future__ import annotations

import anyio

from hearthlm.bench.lora import bench_lora
from hearthlm.cli import build_parser
from hearthlm.session import Session


def test_every_timed_run_prefills_prompts_of_its_own(smollm2_path, monkeypatch):
    """Rows per level with a ratio of the two medians (the whole requests', and decoding's alone); in the
    timed runs (6 tokens: the warm-up asks 4), no two requests share a prompt's start, so none skips its
    prefill on another run's cached blocks, and stream i of an adapter run uses adapter i mod N. Mutation:
    the runs' prompts not offset by round (the same prompts each round, as before) fails the distinctness."""
    # 48-token prompts: what is checked is which prompts run, not their length (512 took 90 s of the suite)
    a = build_parser().parse_args(["bench", "--model", str(smollm2_path), "--lora-adapters", "2", "--lora-rank", "4",
                                   "--prompt-tokens", "48", "--concurrency", "1,2", "--decode-tokens", "6",
                                   "--repeat", "2", "--threads", "1"])
    seen = []
    real = Session.stream

    def spy(self, prompt, **kw):
        seen.append((tuple(prompt), kw.get("max_tokens"), kw.get("adapters")))
        return real(self, prompt, **kw)
    monkeypatch.setattr(Session, "stream", spy)
    rows, facts = anyio.run(bench_lora, a)
    assert [(r["concurrency"], r["adapters"]) for r in rows] == [(1, 1), (2, 2)]
    for r in rows:
        assert r["ratio"] == r["lora_tok_s"] / r["base_tok_s"] and r["base_tok_s"] > 0
        # decoding's rate leaves the prefill out: above the whole requests' rate
        assert r["decode_ratio"] == r["lora_decode_tok_s"] / r["base_decode_tok_s"]
        assert r["base_decode_tok_s"] > r["base_tok_s"] and r["lora_decode_tok_s"] > r["lora_tok_s"]
    timed = [(p, ad) for p, m, ad in seen if m == 6]
    assert len(timed) == 2 * 2 * (1 + 2)  # rounds x (base, adapters) x streams over the levels
    assert len({p[:8] for p, _ in timed}) == len(timed)
    assert sorted(str(ad) for _, ad in timed if ad) == sorted(["{'r0': 1.0}"] * 4 + ["{'r1': 1.0}"] * 2)
    assert facts["rank"] == 4 and facts["adapter_mb"] > 0
