"""The fields clients send beyond the basics: logit_bias, min_tokens, n (one prompt, its KV
shared, a seed stream per choice), prompt log-probs (Session.score, echo with logprobs), on the
Session and through the openai client."""
from __future__ import annotations

import math

import numpy as np
import pytest
from tiny_gguf import write_tiny

from hearthlm import Session
from hearthlm.core.errors import ContextLengthError, InvalidRequestError
from hearthlm.runtime.sampling import SamplingParams

PROMPT = "hello there, how are you today? " * 3  # > 2 KV blocks of 16 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("fields") / "tiny.gguf"))


@pytest.fixture
async def session(tiny):
    async with Session.open(tiny, n_ctx=512, weight_cache=False) as s:
        yield s


async def test_logit_bias(session):
    s = session
    base = await s.generate(PROMPT, max_tokens=4, temperature=0)
    t0 = base.token_ids[0]
    banned = await s.generate(PROMPT, max_tokens=4, temperature=0, logit_bias={t0: -math.inf})
    assert t0 not in banned.token_ids
    pick = 200 if t0 != 200 else 201
    pushed = await s.generate(PROMPT, max_tokens=4, temperature=0, logit_bias={pick: 1e4})
    assert pushed.token_ids == [pick] * 4
    # the biased logits are what top_logprobs reports: the pushed token has all the mass
    lp = await s.generate(PROMPT, max_tokens=1, temperature=0, logit_bias={pick: 1e4}, top_logprobs=2)
    assert lp.top_logprobs[0][0][0] == pick and lp.top_logprobs[0][0][1] > -1e-6
    for bad in ({-1: 1.0}, {"a": 1.0}, {1: "x"}, {1: math.inf}, {True: 1.0}, 5):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await s.generate(PROMPT, max_tokens=2, logit_bias={10**6: 1.0})


async def test_min_tokens_holds_off_every_end(session):
    s = session
    base = await s.generate(PROMPT, max_tokens=6, temperature=0)
    t0 = base.token_ids[0]
    ended = await s.generate(PROMPT, max_tokens=6, temperature=0, stop_token_ids=[t0])
    assert ended.token_ids == [] and ended.finish_reason == "stop"
    held = await s.generate(PROMPT, max_tokens=6, temperature=0, stop_token_ids=[t0], min_tokens=3)
    assert len(held.token_ids) >= 3 and t0 not in held.token_ids[:3]
    # a stop string is not looked for before min_tokens either
    first = s.detokenize(base.token_ids[:1])
    cut = await s.generate(PROMPT, max_tokens=6, temperature=0, stop=first)
    assert cut.text == "" and cut.finish_reason == "stop"
    kept = await s.generate(PROMPT, max_tokens=6, temperature=0, stop=first, min_tokens=4)
    assert len(kept.token_ids) >= 4 and kept.text.startswith(s.detokenize(base.token_ids[:4]))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        await s.generate(PROMPT, max_tokens=2, min_tokens=-1)


async def test_n_choices_share_the_prompt_and_follow_their_seeds(session):
    s = session
    kw = dict(max_tokens=8, temperature=10.0, top_k=0, top_p=1.0, min_p=0.0)  # the tiny model is peaked
    hits = s.stats()["prefix_cache_hit_tokens"]
    cs = await s.generate_n(PROMPT, n=3, seed=7, **kw)
    n_prompt = cs[0].prompt_tokens
    # choices 1 and 2 took the prompt's full blocks from choice 0
    assert s.stats()["prefix_cache_hit_tokens"] - hits == 2 * ((n_prompt - 1) // 16 * 16)
    singles = [await s.generate(PROMPT, seed=7 + i, **kw) for i in range(3)]
    assert [c.token_ids for c in cs] == [c.token_ids for c in singles]  # choice i: seed + i
    assert len({tuple(c.token_ids) for c in cs}) > 1
    # streamed: chunks carry their choice's index and add up to the same choices
    parts: dict[int, list[int]] = {}
    async for ch in s.stream(PROMPT, n=3, seed=7, **kw):
        parts.setdefault(ch.index, []).extend(ch.token_ids)
    assert [parts[i] for i in range(3)] == [c.token_ids for c in cs]
    with pytest.raises(InvalidRequestError, match="generate_n"):
        await s.generate(PROMPT, n=2)
    with pytest.raises(InvalidRequestError, match="n must be"):
        await s.generate_n(PROMPT, n=0)
    assert s.stats()["kv_blocks_used"] == 0


async def test_score_against_the_sampled_tokens_logprob(session):
    """score(P + [t])[-1] is the log-prob generate() reports for t after P; the first values agree
    with a prefix's, and a prompt longer than one scoring step (256 tokens) is scored in chunks."""
    s = session
    ids = s.tokenize(PROMPT * 4, add_special=True)[:300]
    g = await s.generate(ids, max_tokens=1, temperature=0, top_logprobs=1)
    t, lp = g.token_ids[0], dict(g.top_logprobs[0])[g.token_ids[0]]
    sc = await s.score(ids + [t])
    assert sc.shape == (300,) and np.all(sc <= 0)
    np.testing.assert_allclose(sc[-1], lp, atol=2e-3)
    short = await s.score(ids[:40])
    np.testing.assert_allclose(sc[:39], short, atol=2e-3)
    # a prompt as long as the whole context is scored (nothing is generated after it)
    full = await s.score((ids * 2)[:512])
    assert full.shape == (511,)
    with pytest.raises(ContextLengthError):
        await s.score((ids * 2)[:513])
    with pytest.raises(InvalidRequestError, match="two tokens"):
        await s.score(ids[:1])
    # echo: generate(prompt_logprobs=k) gives the same values, with the k alternatives
    e = await s.generate(ids[:40], max_tokens=2, temperature=0, prompt_logprobs=2)
    assert e.prompt_logprobs[0] == (ids[0], None, None) and len(e.prompt_logprobs) == 40
    np.testing.assert_allclose([lp for _, lp, _ in e.prompt_logprobs[1:]], short, atol=2e-3)
    assert all(len(top) >= 2 and top[0][1] >= top[1][1] for _, _, top in e.prompt_logprobs[1:])
    assert s.stats()["kv_blocks_used"] == 0


async def test_score_matches_the_reference_backend(tiny):
    ids = list(range(3, 90))
    async with Session.open(tiny, n_ctx=512, weight_cache=False) as cpu, \
            Session.open(tiny, n_ctx=512, backend="reference") as ref:
        # the tiny model's logits are large (log-probs of -20 to -60): the CPU's 8-bit activations
        # move them by about a percent
        a, b = await cpu.score(ids), await ref.score(ids)
        np.testing.assert_allclose(a, b, rtol=0.02, atol=0.05)
        assert np.corrcoef(a, b)[0, 1] > 0.999


def test_server_fields(tiny):
    openai = pytest.importorskip("openai")
    from serve_util import live_server
    with live_server(tiny, "--n-ctx", "512") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hello there"}]
        r = c.chat.completions.create(model=tiny, messages=msgs, max_tokens=6, n=3, temperature=10.0, seed=3)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert 3 <= r.usage.completion_tokens <= 18
        streamed: dict[int, str] = {}
        for ch in c.chat.completions.create(model=tiny, messages=msgs, max_tokens=6, n=3, temperature=10.0, seed=3,
                                            stream=True):
            for choice in ch.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
        assert [streamed[i] for i in range(3)] == [ch.message.content for ch in r.choices]
        base = c.chat.completions.create(model=tiny, messages=msgs, max_tokens=3, temperature=0, logprobs=True)
        first = base.choices[0].logprobs.content[0]
        t0, id0 = first.token, 3 + first.bytes[0]  # the tiny vocabulary: 3 specials, then the 256 bytes
        biased = c.chat.completions.create(model=tiny, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                           logit_bias={str(id0): -100})
        assert biased.choices[0].logprobs.content[0].token != t0
        # llama-server's string keys and false: each token of the string banned
        banned = c.chat.completions.create(model=tiny, messages=msgs, max_tokens=3, temperature=0,
                                           extra_body={"logit_bias": [[t0, False]]})
        assert t0 not in banned.choices[0].message.content
        held = c.chat.completions.create(model=tiny, messages=msgs, max_tokens=6, temperature=0,
                                         stop=[t0], extra_body={"min_tokens": 3})
        assert len(held.choices[0].message.content) >= 1 and held.usage.completion_tokens >= 3
        # echo with logprobs: the prompt's tokens first, the first one's logprob null
        e = c.completions.create(model=tiny, prompt="hello there", max_tokens=2, temperature=0, echo=True, logprobs=1)
        lp = e.choices[0].logprobs
        assert e.choices[0].text.startswith("hello there")
        n_prompt = e.usage.prompt_tokens
        assert len(lp.tokens) == n_prompt + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens).startswith("hello there")
        assert lp.text_offset == sorted(lp.text_offset)
        # scoring only: max_tokens 0 with echo (lm-evaluation-harness's loglikelihood)
        z = c.completions.create(model=tiny, prompt="hello there", max_tokens=0, echo=True, logprobs=0)
        assert z.choices[0].text == "hello there" and z.choices[0].finish_reason == "length"
        assert z.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-3)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=tiny, prompt="hello there", max_tokens=0)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=tiny, messages=msgs, max_tokens=2, n=17)
