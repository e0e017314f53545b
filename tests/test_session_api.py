"""The public Session API on the real SmolLM2-135M-Instruct model: generate and stream
agree, token ids and text are consistent, top_logprobs, stop strings and stop tokens,
seeds, chat messages, concurrency, cancellation, trio, and the tokenizer round trip.

Each test opens one Session and checks several things in sequence (few sessions, few
tokens: the suite must stay cheap on two busy cores)."""
from __future__ import annotations

import math

import anyio
import pytest

from hearthlm import Chunk, Completion, Session
from hearthlm.model_zoo.chat_template import render_chat

N_CTX = 256
PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer ..."
NON_ASCII_PROMPT = "早上好，"  # greedy: Chinese text, some characters split over byte tokens


def open_session(path, **kw):
    return Session.open(str(path), n_ctx=N_CTX, **kw)


async def collect(agen) -> list[Chunk]:
    return [c async for c in agen]


def check_chunks(chunks: list[Chunk], completion: Completion) -> None:
    """A stream's chunks add up to the completion of the same (greedy) request."""
    assert chunks, "no chunks"
    assert all(isinstance(c, Chunk) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids
    assert "".join(c.text for c in chunks) == completion.text
    assert chunks[-1].finish_reason == completion.finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])


def assert_stopped_at(s: Session, ids: list[int], full_ids: list[int], stop: str) -> None:
    """`ids` run at least to the token that completes `stop` in the greedy `full_ids`. (Exactly
    to it while the consumer keeps up: see test_stop_string_cuts_token_ids_too.)"""
    n = next(k for k in range(1, len(full_ids) + 1) if stop in s.detokenize(full_ids[:k]))
    assert ids[:n] == full_ids[:n], (ids, full_ids, n)


async def wait_idle(s: Session, timeout: float = 10.0) -> dict:
    """Stats once no request runs and no KV block is held (or after `timeout` seconds). An
    aborted request leaves at the end of the engine step in flight: a fraction of a second,
    but seconds on an overloaded machine; callers also check that nothing ran on."""
    with anyio.move_on_after(timeout):
        while True:
            st = s.stats()
            if st["running_requests"] == 0 and st["kv_blocks_used"] == 0 and st["queue_depth"] == 0:
                break
            await anyio.sleep(0.02)
    return s.stats()


async def test_generate_stream_and_logprobs(smollm2_path):
    async with open_session(smollm2_path) as s:
        # a string prompt
        c = await s.generate(PROMPT, max_tokens=6, temperature=0)
        assert isinstance(c, Completion)
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
        assert all(isinstance(t, int) for t in c.token_ids)
        assert c.text == s.detokenize(c.token_ids) and c.text.strip()
        ids = s.tokenize(PROMPT, add_special=True)
        assert c.prompt_tokens == len(ids)
        assert c.top_logprobs is None  # not asked for

        # the same prompt as token ids: the same completion
        c_ids = await s.generate(ids, max_tokens=6, temperature=0)
        assert (c_ids.token_ids, c_ids.text, c_ids.finish_reason, c_ids.prompt_tokens) == \
            (c.token_ids, c.text, c.finish_reason, c.prompt_tokens)

        # stream (asking for top_logprobs too): the chunks add up to generate's completion
        k = 5
        chunks = await collect(s.stream(PROMPT, max_tokens=6, temperature=0, top_logprobs=k))
        check_chunks(chunks, c)
        for ch in chunks:
            assert len(ch.top_logprobs or []) == len(ch.token_ids)

        # top_logprobs: per token k (id, logprob) pairs, most likely first
        lp = await s.generate(PROMPT, max_tokens=4, temperature=0, top_logprobs=k)
        assert lp.token_ids == c.token_ids[:4] and lp.finish_reason == "length"
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == len(lp.token_ids)
        for tok, top in zip(lp.token_ids, lp.top_logprobs):
            assert len(top) == k
            assert all(isinstance(i, int) and 0 <= i < s.model.n_vocab for i, _ in top)
            assert len({i for i, _ in top}) == k
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0.0 for v in values)
            assert top[0][0] == tok  # greedy: the chosen token is the most likely
        # log-probabilities of one distribution: the k probabilities sum to at most 1
        assert 0 < sum(math.exp(v) for _, v in lp.top_logprobs[0]) <= 1 + 1e-6
        streamed = [t for ch in chunks for t in (ch.top_logprobs or [])][:4]
        assert [[i for i, _ in t] for t in streamed] == [[i for i, _ in t] for t in lp.top_logprobs]
        for a, b in zip(streamed, lp.top_logprobs):
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)

        # non-ASCII output: characters whose UTF-8 bytes span tokens are never split
        zh = await s.generate(NON_ASCII_PROMPT, max_tokens=8, temperature=0)
        assert any(ord(ch) > 0x2E80 for ch in zh.text), zh.text  # CJK came out
        assert "\ufffd" not in zh.text and zh.text == s.detokenize(zh.token_ids)
        assert any(s.detokenize([t]) == "\ufffd" for t in zh.token_ids)  # some token is part of a char
        zh_chunks = await collect(s.stream(NON_ASCII_PROMPT, max_tokens=8, temperature=0))
        check_chunks(zh_chunks, zh)
        assert not [c.text for c in zh_chunks if "\ufffd" in c.text]

        st = await wait_idle(s)
        assert st["kv_blocks_used"] == 0 and st["running_requests"] == 0


async def test_stops_seeds_and_chat(smollm2_path):
    async with open_session(smollm2_path) as s:
        full = await s.generate(PROMPT, max_tokens=6, temperature=0)
        pieces = [s.detokenize([t]) for t in full.token_ids]
        assert "\n" in full.text, full.text

        # stop=["\n"]: cut before the newline
        c = await s.generate(PROMPT, max_tokens=6, temperature=0, stop=["\n"])
        assert c.finish_reason == "stop" and "\n" not in c.text
        assert c.text == full.text[:full.text.index("\n")]
        assert_stopped_at(s, c.token_ids, full.token_ids, "\n")
        # the same through stream, with a stop string that never occurs beside it
        chunks = await collect(s.stream(PROMPT, max_tokens=6, temperature=0, stop=["\n", "#nowhere#"]))
        assert "".join(ch.text for ch in chunks) == c.text
        assert chunks[-1].finish_reason == "stop" and all(ch.finish_reason is None for ch in chunks[:-1])
        assert_stopped_at(s, [t for ch in chunks for t in ch.token_ids], full.token_ids, "\n")

        # a stop string split across two tokens (" Paris" + "."): still stops
        assert len(pieces[0]) >= 2 and pieces[1]
        split = pieces[0][-2:] + pieces[1][:1]
        assert not any(split in p for p in pieces)
        expected = full.text[:full.text.index(split)]
        c = await s.generate(PROMPT, max_tokens=6, temperature=0, stop=split)
        assert (c.text, c.finish_reason) == (expected, "stop")
        assert_stopped_at(s, c.token_ids, full.token_ids, split)
        chunks = await collect(s.stream(PROMPT, max_tokens=6, temperature=0, stop=[split]))
        assert "".join(ch.text for ch in chunks) == expected and chunks[-1].finish_reason == "stop"
        assert split[:-1] not in "".join(ch.text for ch in chunks)  # the held-back start never leaked

        # stop_token_ids: the greedy 2nd token ends the generation before it
        second = full.token_ids[1]
        assert second != full.token_ids[0]
        c = await s.generate(PROMPT, max_tokens=6, temperature=0, stop_token_ids=[second])
        assert c.token_ids == full.token_ids[:1] and c.finish_reason == "stop"
        assert c.text == s.detokenize(full.token_ids[:1])

        # seeds: the same seed samples the same tokens; other seeds (almost surely) not all
        story = "Once upon a time"
        a = await s.generate(story, max_tokens=5, temperature=0.9, seed=7)
        b = await s.generate(story, max_tokens=5, temperature=0.9, seed=7)
        assert a.token_ids == b.token_ids and a.text == b.text
        others = [(await s.generate(story, max_tokens=5, temperature=0.9, seed=n)).token_ids for n in (8, 9)]
        assert any(o != a.token_ids for o in others), others

        # chat messages: the rendered template, tokenized with its special tokens
        messages = [{"role": "user", "content": "What is 2+2?"}]
        chat = await s.generate(messages=messages, max_tokens=8, temperature=0)
        assert chat.text.strip() and chat.finish_reason in ("stop", "length")
        assert len(chat.token_ids) <= 8
        tok = s.model.tokenizer
        rendered = render_chat(s.model.chat_template, messages, add_generation_prompt=True,
                               bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id))
        assert rendered.endswith("<|im_start|>assistant\n") and "What is 2+2?" in rendered
        assert chat.prompt_tokens == len(tok.encode(rendered, parse_special=True))
        # the template's special tokens are single tokens, not text
        assert tok.token_id("<|im_start|>") in tok.encode(rendered, parse_special=True)

        st = await wait_idle(s)
        assert st["kv_blocks_used"] == 0 and st["running_requests"] == 0


async def test_stop_string_cuts_token_ids_too(smollm2_path):
    async with open_session(smollm2_path) as s:
        full = await s.generate(PROMPT, max_tokens=6, temperature=0)
        n = next(k for k in range(1, 7) if "\n" in s.detokenize(full.token_ids[:k]))
        expected = full.token_ids[:n]  # up to the token that holds the newline
        agen = s.stream(PROMPT, max_tokens=6, temperature=0, stop=["\n"], top_logprobs=2)
        chunks = [await agen.__anext__()]
        with anyio.fail_after(120):  # a slow consumer: the engine finishes all 6 tokens meanwhile
            while s.stats()["running_requests"]:
                await anyio.sleep(0.02)
        chunks += [ch async for ch in agen]
        slow = [t for ch in chunks for t in ch.token_ids]
        assert "".join(ch.text for ch in chunks) == full.text[:full.text.index("\n")]  # right either way
        assert slow == expected
        assert sum(len(ch.top_logprobs or []) for ch in chunks) == len(expected)


CONCURRENT = [PROMPT, "One, two, three,", NON_ASCII_PROMPT, "def add(a, b):"]


async def test_concurrent_requests_match_alone(smollm2_path):
    async with open_session(smollm2_path) as s:
        steps0 = s.stats()["steps"]
        alone = [(await s.generate(p, max_tokens=4, temperature=0)).token_ids for p in CONCURRENT]
        steps_alone = s.stats()["steps"] - steps0

        together: list = [None] * len(CONCURRENT)

        async def run(i: int) -> None:
            together[i] = (await s.generate(CONCURRENT[i], max_tokens=4, temperature=0)).token_ids

        steps0 = s.stats()["steps"]
        async with anyio.create_task_group() as tg:
            for i in range(len(CONCURRENT)):
                tg.start_soon(run, i)
        assert together == alone
        assert s.stats()["steps"] - steps0 < steps_alone  # they were batched
        st = await wait_idle(s)
        assert st["kv_blocks_used"] == 0 and st["running_requests"] == 0


async def test_cancellation_frees_the_request(smollm2_path):
    async with open_session(smollm2_path) as s:
        baseline = await s.generate("Hello", max_tokens=2, temperature=0)
        generated0 = s.stats()["tokens_generated"]

        # a cancel scope around the consumer, cancelled mid-stream
        got: list[Chunk] = []
        with anyio.CancelScope() as scope:
            async for ch in s.stream("Once upon a time", max_tokens=200, temperature=0):
                got.append(ch)
                if len(got) == 2:
                    scope.cancel()
        assert scope.cancelled_caught and len(got) == 2
        st = await wait_idle(s)
        assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0, st
        assert (await s.generate("Hello", max_tokens=2, temperature=0)).token_ids == baseline.token_ids

        # a timeout around a task: the request goes away with the task
        with anyio.move_on_after(0.3):
            await s.generate("Once upon a time", max_tokens=200, temperature=0)
        st = await wait_idle(s)
        assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0, st

        # breaking out of `async for`
        n = 0
        async for _ in s.stream("Once upon a time", max_tokens=200, temperature=0):
            n += 1
            if n == 2:
                break
        st = await wait_idle(s)
        assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0, st
        assert st["tokens_generated"] - generated0 < 200  # none of the three ran on to its 200 tokens

        assert (await s.generate("Hello", max_tokens=2, temperature=0)).token_ids == baseline.token_ids


def test_trio(smollm2_path):
    pytest.importorskip("trio")

    async def main():
        async with open_session(smollm2_path) as s:
            c = await s.generate("Hello", max_tokens=3, temperature=0)
            chunks = await collect(s.stream("Hello", max_tokens=3, temperature=0))
            with anyio.CancelScope() as scope:  # cancellation under trio too
                async for _ in s.stream("Once upon a time", max_tokens=200, temperature=0):
                    scope.cancel()
            return c, chunks, await wait_idle(s)

    c, chunks, st = anyio.run(main, backend="trio")
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    check_chunks(chunks, c)
    assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0


ROUND_TRIP = ["Hello, world!", "  two leading spaces", "tabs\tand\nnew lines\n\n", "日本語と中文 and emoji 😀👍",
              "Ünïcödé àccents", "<|im_start|> is text here", "x" * 300, ""]


async def test_tokenize_round_trip(smollm2_path):
    async with open_session(smollm2_path) as s:
        n_vocab = s.model.n_vocab
        for text in ROUND_TRIP:
            ids = s.tokenize(text)
            assert all(isinstance(i, int) and 0 <= i < n_vocab for i in ids)
            assert s.detokenize(ids) == text, text
            with_special = s.tokenize(text, add_special=True)  # SmolLM2 adds no BOS
            assert with_special == ids
        assert s.tokenize("") == []
        # plain tokenize does not parse special-token text: no control token from user text
        assert s.model.tokenizer.token_id("<|im_start|>") not in s.tokenize("<|im_start|>")
        assert len(s.tokenize("Hello world")) < len("Hello world")  # merges happen
