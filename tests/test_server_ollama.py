"""The Ollama API of `hearthlm serve` (/api/...) through the official ollama client, sync and
async, against a live server on 127.0.0.1 serving two tiny synthetic models (one whose
template thinks): chat and generate, streamed and not, options, format, think, tools,
embeddings, the model listings, Ollama's error shapes, and disconnects."""
from __future__ import annotations

import asyncio
import json
import math
import re
from importlib import metadata

import httpx
import pytest

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_util import live_server, wait_for  # noqa: E402
from test_reasoning import OPENS  # noqa: E402
from tiny_gguf import CHATML, write_tiny  # noqa: E402

KEY = "sk-ollama-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMS}}
# the tiny model's random weights call no tool of their own accord: a format holding a call's JSON
# makes the reply one, which the Hermes parser (the tiny llama's format) reads as a bare call
# the tiny model's context is 512 byte-level tokens: a template that names the tools itself, not
# the long Hermes system prompt that templates ignoring tools get
TOOLS_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\\ntools:' }}{% for t in tools %}{{ ' ' + t.function.name }}"
                  "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}" + CHATML)
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMS},
        "required": ["name", "arguments"], "additionalProperties": False}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ollama")
    return {"tiny": str(write_tiny(d / "tiny.gguf")),
            "thinker": str(write_tiny(d / "thinker.gguf", chat_template=OPENS)),
            "tooler": str(write_tiny(d / "tooler.gguf", chat_template=TOOLS_TEMPLATE))}


@pytest.fixture(scope="module")
def server(paths):
    with live_server(*(f"{n}={p}" for n, p in paths.items()), "--api-key", KEY, "--n-ctx", "512") as url:
        yield url


def client(url) -> "ollama.Client":
    return ollama.Client(host=url, headers=AUTH, timeout=60)


def oai(url) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def engine(url: str, model: str) -> dict[str, float]:
    """/metrics of one served model, {name: value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^(\w+)\{model="([^"]*)"\} (\S+)$', line)
        if m and m.group(2) == model:
            out[m.group(1)] = float(m.group(3))
    return out


def test_chat_sync_and_stream(server):
    c = client(server)
    r = c.chat(model="tiny", messages=MSGS, options={"num_predict": 12, "temperature": 0})
    assert r.message.role == "assistant" and r.message.content and r.done and r.message.thinking is None
    assert r.done_reason in ("stop", "length") and r.eval_count <= 12 and r.prompt_eval_count > 3
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0 and r.load_duration == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", r.created_at)
    parts = list(c.chat(model="tiny:latest", messages=MSGS, options={"num_predict": 12, "temperature": 0},
                        stream=True))  # Ollama's default tag is taken for a served name
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == r.message.content
    last = parts[-1]
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == (r.done_reason, r.eval_count,
                                                                            r.prompt_eval_count)
    assert {p.model for p in parts} == {"tiny:latest"}  # the name as asked, as Ollama echoes it
    lp = c.chat(model="tiny", messages=MSGS, options={"num_predict": 12, "temperature": 0}, logprobs=True,
                top_logprobs=2)
    assert len(lp.logprobs) == lp.eval_count and "".join(t.token for t in lp.logprobs) == r.message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in lp.logprobs)


def test_same_text_as_openai_route(server):
    """The options are the OpenAI fields under Ollama's names: greedy, and sampled with a seed."""
    c, o = client(server), oai(server)
    for temp in (0.0, 0.9):
        opts = {"seed": 7, "temperature": temp, "num_predict": 16, "top_k": 20, "top_p": 0.9, "repeat_penalty": 1.1}
        mine = c.chat(model="tiny", messages=MSGS, options=opts)
        theirs = o.chat.completions.create(model="tiny", messages=MSGS, seed=7, temperature=temp, max_tokens=16,
                                           top_p=0.9, extra_body={"top_k": 20, "repeat_penalty": 1.1})
        assert mine.message.content == theirs.choices[0].message.content, temp
        assert mine.eval_count == theirs.usage.completion_tokens
        assert mine.prompt_eval_count == theirs.usage.prompt_tokens
        raw = c.generate(model="tiny", prompt="the quick brown", raw=True, options=opts)
        legacy = o.completions.create(model="tiny", prompt="the quick brown", seed=7, temperature=temp, max_tokens=16,
                                      top_p=0.9, extra_body={"top_k": 20, "repeat_penalty": 1.1})
        assert raw.response == legacy.choices[0].text, temp
    sampled = [c.chat(model="tiny", messages=MSGS, options={"seed": s, "temperature": 1.5, "num_predict": 16})
               .message.content for s in (1, 2)]
    assert sampled[0] != sampled[1]  # the seed is used, not dropped


def test_num_predict_and_stop(server):
    c = client(server)
    five = c.chat(model="tiny", messages=MSGS, options={"num_predict": 5, "temperature": 0})
    assert five.eval_count == 5 and five.done_reason == "length"
    full = c.chat(model="tiny", messages=MSGS, options={"num_predict": -1, "temperature": 0})  # until the context
    assert full.eval_count > 5 and full.message.content.startswith(five.message.content)
    if full.done_reason == "length":
        assert full.eval_count + full.prompt_eval_count == 512
    text = c.chat(model="tiny", messages=MSGS, options={"num_predict": 24, "temperature": 0}).message.content
    stop = text[3:5]
    cut = c.chat(model="tiny", messages=MSGS, options={"num_predict": 24, "temperature": 0, "stop": [stop]})
    assert cut.message.content == text[:text.index(stop)] and cut.done_reason == "stop"


def test_generate(server):
    c = client(server)
    opts = {"num_predict": 6, "temperature": 0}
    templ = c.generate(model="tiny", prompt="abc", options=opts)
    raw = c.generate(model="tiny", prompt="abc", raw=True, options=opts)
    assert raw.prompt_eval_count == 3 < templ.prompt_eval_count  # the chat template wraps it unless raw
    sysd = c.generate(model="tiny", prompt="abc", system="be brief", options=opts)
    assert sysd.prompt_eval_count > templ.prompt_eval_count
    chat = c.chat(model="tiny", messages=[{"role": "user", "content": "abc"}], options=opts)
    assert templ.response == chat.message.content and templ.eval_count == 6
    parts = list(c.generate(model="tiny", prompt="abc", options=opts, stream=True))
    assert "".join(p.response for p in parts) == templ.response and parts[-1].done and parts[-1].eval_count == 6
    loaded = c.generate(model="tiny")  # Ollama's "load the model": no prompt
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert c.chat(model="tiny", messages=[]).done_reason == "load"
    for bad, word in ((dict(suffix="end"), "suffix"), (dict(template="{{ .Prompt }}"), "template"),
                      (dict(context=[1, 2]), "context"), (dict(raw=True, system="x"), "system"),
                      (dict(images=[b"\x89PNG"]), "images")):
        with pytest.raises(ollama.ResponseError) as e:
            c.generate(model="tiny", prompt="abc", **bad)
        assert e.value.status_code == 400 and word in e.value.error, bad


async def test_async_client_concurrent(server):
    c = ollama.AsyncClient(host=server, headers=AUTH, timeout=60)
    opts = {"num_predict": 8, "temperature": 0}
    prompts = [f"request number {i}" for i in range(5)]
    singles = [(await c.generate(model="tiny", prompt=p, raw=True, options=opts)).response for p in prompts[:2]]

    async def streamed(p):
        return "".join([part.response async for part in await c.generate(model="tiny", prompt=p, raw=True,
                                                                          options=opts, stream=True)])

    async def chatted(p):
        return (await c.chat(model="tiny", messages=[{"role": "user", "content": p}], options=opts)).message.content
    together = await asyncio.gather(*(streamed(p) for p in prompts), *(chatted(p) for p in prompts))
    assert together[:2] == singles  # batched with the others, greedy output is unchanged
    assert all(together)
    assert sorted(m.model for m in (await c.list()).models) == ["thinker", "tiny", "tooler"]


def test_format_json_schema(server):
    c = client(server)
    q = [{"role": "user", "content": "Is it ok? Answer in JSON."}]
    r = c.chat(model="tiny", messages=q, format=SCHEMA, options={"num_predict": 64, "temperature": 0})
    assert r.done_reason == "stop", r
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    parts = list(c.chat(model="tiny", messages=q, format=SCHEMA, options={"num_predict": 64, "temperature": 0.7,
                                                                        "seed": 3}, stream=True))
    jsonschema.validate(json.loads("".join(p.message.content for p in parts)), SCHEMA)
    g = c.generate(model="tiny", prompt="JSON please", format="json", options={"num_predict": 32, "temperature": 0})
    # random weights may go on listing keys: an object is begun, and whole if it ended
    assert g.response.startswith("{") and (g.done_reason == "length" or isinstance(json.loads(g.response), dict))
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="tiny", messages=q, format={"type": "nonsense-type"})
    assert e.value.status_code == 400


def test_think(server):
    c, o = client(server), oai(server)
    opts = {"num_predict": 16, "temperature": 0}
    r = c.chat(model="thinker", messages=MSGS, think=True, options=opts)
    # random weights never close the thinking the template opened: all of it is thinking
    assert r.message.thinking and r.message.content == "" and "<think>" not in r.message.thinking
    theirs = o.chat.completions.create(model="thinker", messages=MSGS, max_tokens=16, temperature=0)
    assert r.message.thinking == theirs.choices[0].message.model_extra["reasoning_content"]
    parts = list(c.chat(model="thinker", messages=MSGS, think=True, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    off = c.chat(model="thinker", messages=MSGS, think=False, options=opts)  # the template closes it
    assert off.message.thinking is None and off.message.content
    g = c.generate(model="thinker", prompt="hello there", think=True, options=opts)
    assert g.thinking == r.message.thinking and g.response == ""
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="tiny", messages=MSGS, think=True)
    assert e.value.status_code == 400 and "thinking" in e.value.error
    assert "thinking" in c.show("thinker").capabilities and "thinking" not in c.show("tiny").capabilities


def test_tools(server):
    c = client(server)
    q = [{"role": "user", "content": "What's the weather in Paris?"}]
    opts = {"num_predict": 128, "temperature": 0}
    r = c.chat(model="tooler", messages=q, tools=[WEATHER], format=CALL, options=opts)
    calls = r.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather", r
    assert isinstance(calls[0].function.arguments, dict)  # an object, not a JSON string
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER_PARAMS)
    assert r.done_reason == "stop" and r.message.content == ""
    raw = httpx.post(server + "/api/chat", headers=AUTH, timeout=60, json=dict(
        model="tooler", messages=q, tools=[WEATHER], format=CALL, options=opts, stream=True))
    lines = [json.loads(x) for x in raw.text.splitlines()]
    got = [x["message"]["tool_calls"] for x in lines if x["message"].get("tool_calls")]
    assert got == [[{"function": {"name": "get_weather", "arguments": dict(calls[0].function.arguments)}}]]
    assert "".join(x["message"]["content"] for x in lines) == ""  # the call's text is not content
    # the call and its result go back in the history, Ollama's way (tool_name, object arguments)
    history = q + [{"role": "assistant", "content": "", "tool_calls": [calls[0]]},
                   {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    after = c.chat(model="tooler", messages=history, tools=[WEATHER], options={"num_predict": 4, "temperature": 0})
    assert after.done and after.eval_count >= 1
    # a Python function, as the client converts it (Google-style docstring)

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
          a: the first
          b: the second
        """
        return a + b
    plain = c.chat(model="tooler", messages=q, tools=[add], options={"num_predict": 4, "temperature": 0})
    assert plain.done and not plain.message.tool_calls


def test_embed(server):
    c, o = client(server), oai(server)
    r = c.embed(model="tiny", input=["hello world", "a"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 64 and r.prompt_eval_count > 2
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in r.embeddings)
    theirs = o.embeddings.create(model="tiny", input=["hello world", "a"], encoding_format="float")
    for a, b in zip(r.embeddings, theirs.data):
        assert max(abs(x - y) for x, y in zip(a, b.embedding)) < 1e-6
    one = c.embed(model="tiny:latest", input="hello world")
    assert one.embeddings == [r.embeddings[0]] and one.model == "tiny:latest"
    assert c.embed(model="tiny", input="").embeddings == []
    legacy = c.embeddings(model="tiny", prompt="hello world").embedding  # not normalized, as Ollama's
    norm = math.sqrt(sum(x * x for x in legacy))
    assert abs(norm - 1) > 1e-3 and max(abs(x / norm - y) for x, y in zip(legacy, r.embeddings[0])) < 1e-5
    long = c.embed(model="tiny", input="word " * 600)  # truncate defaults to true, as Ollama's
    assert len(long.embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model="tiny", input="word " * 600, truncate=False)
    assert e.value.status_code == 400


def test_tags_show_ps_version(server, paths):
    import os
    c = client(server)
    tags = c.list().models
    assert sorted(m.model for m in tags) == ["thinker", "tiny", "tooler"]
    raw = httpx.get(server + "/api/tags", headers=AUTH).json()["models"]
    assert {m["name"] for m in raw} == {"thinker", "tiny", "tooler"} and all(len(m["digest"]) == 64 for m in raw)
    tiny = next(m for m in tags if m.model == "tiny")
    assert tiny.size == os.path.getsize(paths["tiny"]) and tiny.modified_at is not None
    d = tiny.details
    assert (d.format, d.family, d.families, d.quantization_level) == ("gguf", "llama", ["llama"], "Q8_0")
    assert d.parameter_size.endswith("K")
    s = c.show("tiny:latest")
    assert s.capabilities == ["completion", "tools"] and s.template.startswith("{% for m in messages %}")
    info = s.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == 512
    assert info["tokenizer.ggml.tokens"] == [] and info["general.parameter_count"] > 10_000
    verbose = httpx.post(server + "/api/show", headers=AUTH, json={"model": "tiny", "verbose": True}).json()
    assert len(verbose["model_info"]["tokenizer.ggml.tokens"]) == 260
    assert "num_ctx 512" in s.parameters and paths["tiny"] in s.modelfile
    ps = c.ps().models
    assert sorted(m.model for m in ps) == ["thinker", "tiny", "tooler"]
    assert all(m.size_vram == 0 and m.expires_at.year == 9999 for m in ps)
    assert [m["context_length"] for m in httpx.get(server + "/api/ps", headers=AUTH).json()["models"]] == [512] * 3
    v = httpx.get(server + "/api/version").json()  # needs no key, as /health
    assert v == {"version": metadata.version("hearthlm")}


def test_error_shapes(server):
    def post(path, **kw):
        return httpx.post(server + path, headers=kw.pop("headers", AUTH), timeout=60, **kw)
    r = post("/api/chat", json=dict(model="nope", messages=MSGS))
    assert r.status_code == 404 and r.json()["error"].startswith('model "nope" not found')
    with pytest.raises(ollama.ResponseError) as e:
        client(server).chat(model="nope", messages=MSGS)
    assert e.value.status_code == 404 and 'model "nope" not found' in e.value.error
    r = post("/api/chat", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    for no_model in (dict(prompt="x"), dict(model="", prompt="x")):  # several are served: which one?
        r = post("/api/generate", json=no_model)
        assert r.status_code == 400 and "model" in r.json()["error"]
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.get(server + "/api/tags", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server).list()
    assert e.value.status_code == 401
    bad_inputs = [dict(messages=[{"role": "user", "content": "x", "images": ["iVBORw0KGgo="]}]),
                  dict(options={"mirostat": 2}), dict(options={"num_predict": 0}), dict(format="yaml"),
                  dict(options={"temperature": -1}), dict(think="sometimes"),
                  dict(messages=[{"role": "user", "content": "x" * 50_000}])]
    for bad in bad_inputs:
        r = post("/api/chat", json={"model": "tiny", "messages": MSGS, "stream": False, **bad})
        assert r.status_code == 400 and isinstance(r.json()["error"], str) and r.json()["error"], bad
    r = post("/api/chat", json=dict(model="tiny", messages=MSGS, options={"num_predict": 2, "num_ctx": 8192,
                                                                          "num_gpu": 99, "mirostat": 0}))
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"  # streamed by default
    assert json.loads(r.text.splitlines()[-1])["done"] is True
    r = post("/api/chat", json=dict(model="tiny", messages=MSGS, stream=False, options={"num_predict": 2}))
    assert r.headers["content-type"] == "application/json" and r.json()["done"] is True
    r = post("/api/nowhere", json={})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


def test_disconnect_frees_the_request(server):
    """A client gone mid-stream, or before a non-streamed reply, aborts its engine request."""
    body = dict(model="tiny", messages=MSGS, options={"num_predict": 480, "temperature": 0})

    def freed(before: float) -> None:
        assert wait_for(lambda: engine(server, "tiny")["hearthlm_running_requests"] == 0, timeout=10)
        m = engine(server, "tiny")
        assert m["hearthlm_kv_blocks_used"] == 0
        assert m["hearthlm_generated_tokens_total"] - before < 480  # aborted, not run to the end
    before = engine(server, "tiny")["hearthlm_generated_tokens_total"]
    with httpx.stream("POST", server + "/api/chat", headers=AUTH, json=body, timeout=60) as r:
        assert json.loads(next(r.iter_lines()))["done"] is False
    freed(before)
    before = engine(server, "tiny")["hearthlm_generated_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # the warm tiny model makes 480 tokens in about 0.2 s: leave sooner
        httpx.post(server + "/api/chat", headers=AUTH, json={**body, "stream": False}, timeout=0.03)
    freed(before)
