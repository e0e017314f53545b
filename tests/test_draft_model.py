"""Speculative decoding with a draft model (Session.open(draft_model=...), runtime.draft): greedy
output identical to plain decoding whether the draft agrees (the model as its own draft) or not (a
model of the same vocabulary with other weights: drafts rolled back); drafting and plain requests
batched together; prompts longer than a step; grammars; the draft's KV blocks returned on finish
and cancel; the vocabulary check and the other refusals at open; a real model as its own draft."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest
from tiny_gguf import write_tiny

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from gather import record_drafts
from models import write as write_parity  # noqa: E402

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    # the target, and a smaller draft of the same vocabulary with weights of its own
    return (str(write_tiny(d / "target.gguf", n_layer=3, context_length=2048)),
            str(write_tiny(d / "draft.gguf", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=5,
                           context_length=2048)))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [1] + [3 + (i * 7 + seed) % 31 for i in range(n)]


def _counts(s) -> tuple[int, int]:
    st = s.stats()
    return st["spec_drafted_tokens"], st["spec_accepted_tokens"]


async def test_the_model_as_its_own_draft_keeps_every_draft(models):
    target, _ = models
    async with Session.open(target, n_ctx=2048, draft_model=target, draft_p_min=0.0) as s:
        ref = await s.generate(_prompt(40), max_tokens=64, speculative="off", top_logprobs=1, **GREEDY)
        assert _counts(s) == (0, 0)  # "off": nothing drafted
        steps = s.stats()["steps"]
        got = await s.generate(_prompt(40), max_tokens=64, top_logprobs=1, **GREEDY)  # the default: the draft model
        drafted, kept = _counts(s)
        st = s.stats()
    assert got.token_ids == ref.token_ids
    assert [t[0][1] for t in got.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-3)
    assert drafted >= 32 and kept >= 0.9 * drafted, (drafted, kept)  # the same model agrees with itself
    assert st["steps"] - steps < 40  # 64 tokens in fewer target steps
    assert st["draft_kv_blocks_used"] == 0 and st["kv_blocks_used"] == 0


async def test_another_draft_is_rolled_back_and_the_output_is_unchanged(models):
    target, draft = models
    async with Session.open(target, n_ctx=2048, draft_model=draft, draft_p_min=0.0) as s:
        for seed in range(3):  # the penalty moves the target off the token it repeats, not the draft
            kw = dict(max_tokens=48, frequency_penalty=1.5, top_logprobs=1, **GREEDY)
            ref = await s.generate(_prompt(30, seed), speculative="off", **kw)
            got = await s.generate(_prompt(30, seed), **kw)
            assert got.token_ids == ref.token_ids
            assert [t[0][1] for t in got.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-3)
        drafted, kept = _counts(s)
        st = s.stats()
    assert 0 < kept < drafted, (drafted, kept)  # some drafts kept, some rolled back
    assert st["draft_kv_blocks_used"] == 0 and st["kv_blocks_used"] == 0


async def test_drafts_after_rollbacks_are_the_draft_models_own_greedy_continuations(tmp_path, monkeypatch):
    """A llama.cpp-parity tiny model (not degenerate) drafting for itself, the target under a
    repetition penalty the draft does not apply: drafts are kept in part and rolled back often,
    and each one equals what the model alone generates greedily after the same tokens, so the
    draft's KV after every rollback holds exactly the kept tokens."""
    path = str(write_parity(tmp_path / "t.gguf", "llama", seed=0))
    seen = record_drafts(monkeypatch)
    kw = dict(max_tokens=60, frequency_penalty=0.7, **GREEDY)
    async with Session.open(path, n_ctx=512, draft_model=path, draft_p_min=0.0) as s:
        ref = await s.generate(_prompt(30), speculative="off", **kw)
        got = await s.generate(_prompt(30), **kw)
        drafted, kept = _counts(s)
    assert got.token_ids == ref.token_ids
    partly = sum(0 < sum(a == b for a, b in zip(d, got.token_ids[len(t) - 31:])) < len(d) for t, d in seen)
    assert 0 < kept < drafted and partly >= 3, (drafted, kept, partly)
    async with Session.open(path, n_ctx=512) as d:
        for tokens, proposed in seen:
            alone = await d.generate(tokens, max_tokens=len(proposed), **GREEDY)
            assert alone.token_ids == proposed, (len(tokens), proposed, alone.token_ids)


async def test_drafting_and_plain_requests_batch_together(models):
    target, draft = models
    prompts = [_prompt(20 + 9 * i, i) for i in range(6)]
    async with Session.open(target, n_ctx=2048, draft_model=draft, draft_p_min=0.0) as s:
        alone = [(await s.generate(p, max_tokens=32, speculative="off", **GREEDY)).token_ids for p in prompts]
        out = [None] * len(prompts)

        async def one(i):
            mode = [None, "off", "ngram"][i % 3]
            out[i] = (await s.generate(prompts[i], max_tokens=32, speculative=mode, **GREEDY)).token_ids
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        # sampled with a seed: a valid run of the length asked, the same twice
        a = await s.generate(prompts[0], max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
        b = await s.generate(prompts[0], max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
        st = s.stats()
    assert out == alone
    assert len(a.token_ids) == 24 and a.token_ids == b.token_ids
    assert st["spec_accepted_tokens"] > 0 and st["draft_kv_blocks_used"] == 0


async def test_a_prompt_longer_than_a_step_and_a_grammar(models):
    target, draft = models
    async with Session.open(target, n_ctx=2048, max_batch_tokens=64, draft_model=target, draft_p_min=0.0) as s:
        long = _prompt(300)  # the draft catches up over five steps of its own
        ref = await s.generate(long, max_tokens=24, speculative="off", **GREEDY)
        got = await s.generate(long, max_tokens=24, **GREEDY)
        assert got.token_ids == ref.token_ids and _counts(s)[1] > 0
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        ref = await s.generate('{"a": 1} {"a": 1} {"a": ', max_tokens=24, temperature=0, response_format=rf,
                               speculative="off")
        got = await s.generate('{"a": 1} {"a": 1} {"a": ', max_tokens=24, temperature=0, response_format=rf)
    assert got.token_ids == ref.token_ids
    if got.finish_reason == "stop":
        json.loads(got.text)


async def test_a_cancelled_request_gives_its_draft_blocks_back(models):
    target, draft = models
    async with Session.open(target, n_ctx=2048, draft_model=draft, draft_p_min=0.0) as s:
        n = 0
        async for _ in s.stream(_prompt(100), max_tokens=200, **GREEDY):
            n += 1
            if n == 5:
                break
        with anyio.fail_after(10):
            while s.stats()["running_requests"]:
                await anyio.sleep(0.01)
        st = s.stats()
        assert st["draft_kv_blocks_used"] == 0 and st["kv_blocks_used"] == 0
        assert (await s.generate(_prompt(10), max_tokens=4, **GREEDY)).token_ids  # still serving


async def test_refusals(models, tmp_path):
    target, draft = models
    other_vocab = str(write_tiny(tmp_path / "other.gguf", renamed={200: "<|other|>"}))
    with pytest.raises(InvalidRequestError, match="cannot draft for this model: token 200 is '<|other|>'"):
        async with Session.open(target, draft_model=other_vocab):
            pass
    # recurrent drafts and targets roll their states back now: tests/test_hybrid_spec.py
    with pytest.raises(InvalidRequestError, match="draft_p_min"):
        async with Session.open(target, draft_model=draft, draft_p_min=2):
            pass
    async with Session.open(target, n_ctx=256) as s:
        with pytest.raises(InvalidRequestError, match="draft_model="):
            await s.generate("x", max_tokens=2, speculative="draft")
        assert (await s.generate("x", max_tokens=2)).token_ids  # the session still serves


@pytest.mark.slow
async def test_a_real_model_as_its_own_draft(smollm2_path):
    """SmolLM2 drafting for itself at the default draft_p_min: identical greedy tokens, most drafts kept."""
    msgs = [{"role": "user", "content": "List the days of the week, one per line."}]
    async with Session.open(str(smollm2_path), n_ctx=1024, draft_model=str(smollm2_path)) as s:
        ref = await s.generate(messages=msgs, max_tokens=48, temperature=0, speculative="off")
        got = await s.generate(messages=msgs, max_tokens=48, temperature=0)
        drafted, kept = _counts(s)
    assert got.token_ids == ref.token_ids
    assert drafted > 0 and kept >= 0.8 * drafted, (drafted, kept)


def test_server_and_cli_take_a_draft_model(models):
    """hearthlm serve --draft-model: requests draft by default (counted in /metrics), "off" gives
    the same greedy text with nothing drafted; hearthlm generate --draft-model prints the same text."""
    import subprocess

    import openai
    from serve_util import live_server, metrics
    target, draft = models
    with live_server(target, "--n-ctx", "512", "--draft-model", draft, "--draft-p-min", "0") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        kw = dict(model=target, prompt="a b c d e f a b c d", max_tokens=16, temperature=0, frequency_penalty=1.5)
        off = c.completions.create(**kw, extra_body={"speculative": "off"}).choices[0].text
        assert metrics(url).get("hearthlm_speculative_drafted_tokens_total", 0) == 0
        assert c.completions.create(**kw).choices[0].text == off
        assert metrics(url)["hearthlm_speculative_drafted_tokens_total"] > 0
    cmd = [sys.executable, "-m", "hearthlm", "generate", "a b c d", "--model", target, "--max-tokens", "12",
           "--temperature", "0"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    drafted = subprocess.run(cmd + ["--draft-model", draft, "--draft-p-min", "0"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    assert drafted == plain and plain.strip()
