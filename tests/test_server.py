"""`hearthlm serve` through the official openai client, sync and async, against a live server
on 127.0.0.1 (the tiny synthetic model: the API layer is under test, not the model): chat and
completions, streamed and not, usage, logprobs, stop, and every error status."""
from __future__ import annotations

import asyncio
import math

import httpx
import pytest

openai = pytest.importorskip("openai")

from serve_util import live_server, metrics, wait_for  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

KEY = "sk-test-key"
LIMIT = 100_000  # --max-body-bytes
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("serve") / "tiny.gguf"))


@pytest.fixture(scope="module")
def server(tiny):
    with live_server(tiny, "--api-key", KEY, "--max-body-bytes", str(LIMIT), "--n-ctx", "512") as url:
        yield url


def client(url, key=KEY, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def test_chat_sync_stream_and_usage(server, tiny):
    c = client(server)
    r = c.chat.completions.create(model=tiny, messages=MSGS, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 3 and 0 < u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # greedy is deterministic, and streaming gives the same text with the same usage at the end
    again = c.chat.completions.create(model=tiny, messages=MSGS, max_completion_tokens=12, temperature=0)
    assert again.choices[0].message.content == text
    chunks = list(c.chat.completions.create(model=tiny, messages=MSGS, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()


def test_sse_ends_with_done(server, tiny):
    r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json=dict(model=tiny, prompt="abc", max_tokens=4, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) >= 2


def test_seed_and_stop(server, tiny):
    c = client(server)
    kw = dict(model=tiny, prompt="the quick brown", max_tokens=16, temperature=1.0)
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert c.completions.create(seed=7, **kw).choices[0].text == a
    full = c.completions.create(model=tiny, prompt="the quick", max_tokens=16, temperature=0).choices[0]
    assert len(full.text) >= 4
    cut = c.completions.create(model=tiny, prompt="the quick", max_tokens=16, temperature=0, stop=[full.text[2:4]])
    assert cut.choices[0].text == full.text[:full.text.index(full.text[2:4])]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(server, tiny):
    c = client(server)
    r = c.chat.completions.create(model=tiny, messages=MSGS, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        lps = [a.logprob for a in t.top_logprobs]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-6
        assert t.logprob == lps[0] and t.top_logprobs[0].token == t.token  # greedy: the top token
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # sampled, without top_logprobs: each token still carries its own logprob
    s = c.chat.completions.create(model=tiny, messages=MSGS, max_tokens=5, temperature=1.5, seed=3, logprobs=True)
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in s.choices[0].logprobs.content)
    # the legacy completions form
    lc = c.completions.create(model=tiny, prompt="abc", max_tokens=4, temperature=0, logprobs=2).choices[0].logprobs
    assert len(lc.tokens) == len(lc.token_logprobs) == len(lc.top_logprobs) == 4
    assert all(len(d) <= 2 and max(d.values()) == lp for d, lp in zip(lc.top_logprobs, lc.token_logprobs))
    assert lc.text_offset == [sum(len(t) for t in lc.tokens[:i]) for i in range(4)]


async def test_async_client_concurrent(server, tiny):
    c = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = [f"request number {i}" for i in range(6)]
    singles = [(await c.completions.create(model=tiny, prompt=p, max_tokens=8, temperature=0)).choices[0].text
               for p in prompts[:2]]

    async def streamed(p):
        out = ""
        async for ch in await c.completions.create(model=tiny, prompt=p, max_tokens=8, temperature=0, stream=True):
            out += ch.choices[0].text
        return out
    together = await asyncio.gather(*(streamed(p) for p in prompts))
    assert together[:2] == singles  # batched with others, greedy output is unchanged
    models = await c.models.list()
    assert [m.id for m in models.data] == [tiny]
    await c.close()


def test_errors(server, tiny):
    c = client(server)
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, key="sk-wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    assert httpx.get(server + "/v1/models").status_code == 401  # no key at all
    assert httpx.get(server + "/health").status_code == 200     # health and metrics need none
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=MSGS)
    assert e.value.body["code"] == "model_not_found"
    for bad in (dict(temperature=-1), dict(n=17), dict(max_tokens=0), dict(top_logprobs=3),
                dict(messages=[{"role": "user", "content": "x" * 50_000}])):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": tiny, "messages": MSGS, **bad})
        assert e.value.status_code == 400 and e.value.body["message"], bad
    with pytest.raises(openai.BadRequestError) as e:  # too long for the context
        c.completions.create(model=tiny, prompt="word " * 600, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(server + "/v1/chat/completions", content=b"{", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # not JSON
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=tiny, prompt="y" * (LIMIT + 10), max_tokens=1)
    assert e.value.status_code == 413 and "bytes" in e.value.body["message"]
    r = httpx.get(server + "/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_response_format_passed_through(server, tiny):
    """The structured-output parameters go to Session.generate as they are (README: the server
    section; llguidance is in the dev extra): a json_schema is obeyed (the greedy reply, masked
    token by token, validates against it) and an invalid one is a 400 naming response_format.
    Mutation: the server dropping response_format (or refusing every one) fails here, where the
    test once passed either way."""
    import json

    import jsonschema
    c = client(server)
    for stream in (False, True):
        kw = dict(model=tiny, messages=MSGS, max_tokens=64, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}})
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            r = c.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (stream, finish, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    for bad in ({"type": "json_schema", "json_schema": "not a dict"}, {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=tiny, messages=MSGS, max_tokens=4, response_format=bad)
        assert "response_format" in e.value.body["message"]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def test_non_streamed_disconnect_aborts(server, tiny):
    """A client that gives up on a non-streamed request frees its KV blocks at once."""
    before = metrics(server)["hearthlm_generated_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # the warm tiny model makes 480 tokens in about 0.2 s: leave sooner
        httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.03,
                   json=dict(model=tiny, prompt="go on", max_tokens=480, temperature=0))
    assert wait_for(lambda: metrics(server)["hearthlm_running_requests"] == 0, timeout=10)
    m = metrics(server)
    assert m["hearthlm_kv_blocks_used"] == 0
    assert m["hearthlm_generated_tokens_total"] - before < 480  # aborted, not run to the end


def test_metrics_text(server, tiny):
    from prometheus_client.parser import text_string_to_metric_families
    client(server).completions.create(model=tiny, prompt="count me", max_tokens=2)
    assert httpx.get(server + "/v1/models/absent", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    r = httpx.get(server + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    kinds = {f.name: f.type for f in text_string_to_metric_families(r.text)}  # parses as Prometheus text
    assert kinds["hearthlm_generated_tokens"] == "counter" and kinds["hearthlm_kv_blocks_used"] == "gauge"
    m = metrics(server)
    for name in ("hearthlm_generated_tokens_total", "hearthlm_time_to_first_token_seconds", "hearthlm_queue_depth",
                 "hearthlm_kv_blocks_used", "hearthlm_graph_cache_hits_total"):
        assert name in m, name
    assert m["hearthlm_generated_tokens_total"] > 0 and m["hearthlm_http_errors_total"] >= 1


def test_speculative_field(server, tiny):
    """The body's speculative field: greedy text as without it, drafts counted in /metrics, an
    unknown kind a 400 that names the field."""
    c = client(server)
    kw = dict(model=tiny, prompt="a b c d e f a b c d e f a b c d", max_tokens=24, temperature=0,
              frequency_penalty=1.5)
    before = metrics(server).get("hearthlm_speculative_drafted_tokens_total", 0)
    plain = c.completions.create(**kw).choices[0].text
    assert c.completions.create(**kw, extra_body={"speculative": "ngram"}).choices[0].text == plain
    assert metrics(server)["hearthlm_speculative_drafted_tokens_total"] > before
    with pytest.raises(openai.BadRequestError, match="speculative"):
        c.completions.create(**kw, extra_body={"speculative": "medusa"})


def test_queue_full_is_429(tiny):
    with live_server(tiny, "--max-seqs", "1", "--max-queued", "1", "--n-ctx", "512") as url:
        async def go():
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

            async def one(i):
                try:
                    await c.completions.create(model=tiny, prompt=f"p{i}", max_tokens=64, temperature=0)
                    return 200
                except openai.RateLimitError as e:
                    assert e.body["type"] == "rate_limit_error"
                    return e.status_code
            got = await asyncio.gather(*(one(i) for i in range(8)))
            await c.close()
            return got
        codes = asyncio.run(go())
    assert set(codes) == {200, 429}, codes


async def test_closed_session_is_503(tiny):
    """create_app over sessions the application owns; once closed, requests get 503."""
    import uvicorn
    from serve_util import free_port

    from hearthlm import Session
    from hearthlm.serve import create_app
    async with Session.open(tiny, n_ctx=256) as s:
        port = free_port()
        srv = uvicorn.Server(uvicorn.Config(create_app({"tiny": s}), host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(srv.serve())
        try:
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
            for _ in range(100):
                if srv.started:
                    break
                await asyncio.sleep(0.05)
            assert (await c.completions.create(model="tiny", prompt="a", max_tokens=2)).choices[0].text is not None
            await s.aclose()
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model="tiny", prompt="a", max_tokens=2)
            assert e.value.status_code == 503
            async with httpx.AsyncClient() as h:
                assert (await h.get(f"http://127.0.0.1:{port}/health")).status_code == 503
            await c.close()
        finally:
            srv.should_exit = True
            await asyncio.wait_for(task, 30)


def test_embeddings_endpoint(server, tiny):
    c = client(server)
    r = c.embeddings.create(model=tiny, input=["hello world", "a"])  # the client asks for base64
    as_floats = c.embeddings.create(model=tiny, input=["hello world", "a"], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 64
    for a, b in zip(r.data, as_floats.data):
        assert abs(sum(x * x for x in a.embedding) - 1) < 1e-4
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert r.usage.prompt_tokens == r.usage.total_tokens > 2
    one = c.embeddings.create(model=tiny, input="hello world", encoding_format="float")
    assert one.data[0].embedding == as_floats.data[0].embedding
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model=tiny, input="x", dimensions=8)
