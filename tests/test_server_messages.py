"""Anthropic's Messages API of `hearthlm serve` (/v1/messages, /v1/messages/count_tokens) through
the official anthropic client against a live server on 127.0.0.1 serving tiny synthetic models
(plain, one whose template names its tools, one that thinks): plain, streamed, multi-turn, a
forced tool's round trip, stop sequences, thinking, count_tokens, the API key as x-api-key and
Anthropic's error shapes; then a plain and a forced-tool round on Qwen2.5-Coder-0.5B."""
from __future__ import annotations

import base64

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_util import live_server  # noqa: E402
from test_reasoning import OPENS  # noqa: E402
from test_server_ollama import TOOLS_TEMPLATE, WEATHER_PARAMS  # noqa: E402
from test_server_vision import N_IMAGE, VISION, ask, data_url, png  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

KEY = "sk-ant-test"
HELLO = [{"role": "user", "content": "hello there"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_PARAMS}
FORCE = {"type": "tool", "name": "get_weather"}
Q = [{"role": "user", "content": "What's the weather in Paris?"}]
T0 = {"temperature": 0}  # the client (2.x) has no sampling arguments of its own; Claude Code sends them


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("messages")
    paths = {"tiny": write_tiny(d / "tiny.gguf"), "thinker": write_tiny(d / "thinker.gguf", chat_template=OPENS),
             "tooler": write_tiny(d / "tooler.gguf", chat_template=TOOLS_TEMPLATE)}
    with live_server(*(f"{n}={p}" for n, p in paths.items()), "--api-key", KEY, "--n-ctx", "512") as url:
        yield url


def client(url, **kw) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=url, **{"api_key": KEY, **kw}, max_retries=0, timeout=60)


def test_plain_like_chat_completions(server):
    """The reply's shape, usage and text equal the chat completion of the same messages (greedy);
    system as a string or as text blocks is one prompt. Mutation: dropping `system` from the
    translated messages fails it (input_tokens)."""
    c = client(server)
    r = c.messages.create(model="tiny", max_tokens=12, messages=HELLO, extra_body=T0)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 12
    o = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", max_tokens=12, messages=HELLO, extra_body=T0)
    assert r.content[0].text == o.choices[0].message.content and r.usage.input_tokens == o.usage.prompt_tokens
    s1 = c.messages.create(model="tiny", max_tokens=4, messages=HELLO, extra_body=T0, system="Be brief.")
    s2 = c.messages.create(model="tiny", max_tokens=4, messages=HELLO, extra_body=T0,
                           system=[{"type": "text", "text": "Be brief."}])
    assert s1.usage.input_tokens == s2.usage.input_tokens > r.usage.input_tokens
    assert s1.content[0].text == s2.content[0].text


def test_stream_events_and_text(server):
    """client.messages.stream: the event sequence, text deltas that concatenate to the final
    message, and the same text and usage as the plain call. Mutation: not closing the text
    block (no content_block_stop) fails it; so does message_delta without usage."""
    c = client(server)
    plain = c.messages.create(model="tiny", max_tokens=16, messages=HELLO, extra_body=T0)
    with c.messages.stream(model="tiny", max_tokens=16, messages=HELLO, extra_body=T0) as st:
        events = list(st)
        final = st.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "ping")]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-1] == "message_stop"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    assert "".join(deltas) == final.content[0].text == plain.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert final.usage.input_tokens == plain.usage.input_tokens == events[0].message.usage.input_tokens


def test_multi_turn_and_count_tokens(server):
    """A conversation's earlier turns reach the prompt, and count_tokens equals the input_tokens
    the generation reports (with system, tools and a tool round). Mutation: counting without
    the tools (count_tokens dropping them) fails it; so does an assistant turn left out."""
    c = client(server)
    turns = HELLO + [{"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]},
                     {"role": "user", "content": "Tell me a story."}]
    r = c.messages.create(model="tiny", max_tokens=4, messages=turns, extra_body=T0)
    one = c.messages.create(model="tiny", max_tokens=4, messages=turns[2:], extra_body=T0)
    assert r.usage.input_tokens > one.usage.input_tokens + len("Hi! How can I help?")  # byte-level tokens
    assert c.messages.count_tokens(model="tiny", messages=turns).input_tokens == r.usage.input_tokens
    kw = dict(model="tooler", system="Use tools.", messages=Q, tools=[WEATHER])
    g = c.messages.create(max_tokens=2, extra_body=T0, **kw)
    assert c.messages.count_tokens(**kw).input_tokens == g.usage.input_tokens
    assert c.messages.count_tokens(model="tooler", system="Use tools.", messages=Q).input_tokens < g.usage.input_tokens


def test_tool_round_trip(server):
    """tool_choice {type: tool} forces a tool_use block (input valid for its schema, stop_reason
    tool_use), streamed as input_json_delta too; its tool_result (string, blocks, is_error) goes
    back into the prompt. Mutation: dropping tool_result blocks from the translation fails it
    (the prompt does not grow); mapping {type: tool} to "auto" fails it (no tool_use)."""
    c = client(server)
    r = c.messages.create(model="tooler", max_tokens=128, extra_body=T0, messages=Q, tools=[WEATHER], tool_choice=FORCE)
    assert r.stop_reason == "tool_use" and r.content[-1].type == "tool_use", r
    use = r.content[-1]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER_PARAMS)
    with c.messages.stream(model="tooler", max_tokens=128, extra_body=T0, messages=Q, tools=[WEATHER],
                           tool_choice=FORCE) as st:
        events = list(st)
        final = st.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input
    base = Q + [{"role": "assistant", "content": [b.model_dump() for b in r.content]}]
    lengths = []
    for result in ("18 C, sunny", [{"type": "text", "text": "18 C, sunny"}]):
        for is_error in (False, True):
            msgs = base + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                         "content": result, "is_error": is_error}]}]
            after = c.messages.create(model="tooler", max_tokens=4, extra_body=T0, messages=msgs, tools=[WEATHER])
            assert after.stop_reason in ("end_turn", "max_tokens") and after.usage.output_tokens >= 1
            lengths.append(after.usage.input_tokens)
    empty = base + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": ""}]}]
    n_empty = c.messages.count_tokens(model="tooler", messages=empty, tools=[WEATHER]).input_tokens
    assert lengths[0] == lengths[2] == n_empty + len("18 C, sunny")
    assert lengths[1] == lengths[3] == lengths[0] + len("Error: ")


def test_stop_sequences(server):
    """A stop sequence ends the text before it: stop_reason "stop_sequence" and stop_sequence
    naming the one met, plain and streamed. Mutation: a Completion without the matched string
    (stop_sequence left None) fails it, as does mapping every "stop" to end_turn."""
    c = client(server)
    # the tiny model repeats one letter; this prompt and seed put a newline before it
    story, seeded = [{"role": "user", "content": "Tell me a story."}], {"temperature": 1.0, "seed": 7}
    full = c.messages.create(model="tiny", max_tokens=24, messages=story, extra_body=seeded).content[0].text
    stop = next(ch for ch in full if ch.isalnum())
    assert full.index(stop) > 0, full  # some text before the stop
    r = c.messages.create(model="tiny", max_tokens=24, messages=story, extra_body=seeded, stop_sequences=["never!", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)]
    with c.messages.stream(model="tiny", max_tokens=24, messages=story, extra_body=seeded, stop_sequences=[stop]) as st:
        final = st.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop and final.content[0].text == r.content[0].text
    plain = c.messages.create(model="tiny", max_tokens=24, messages=HELLO, extra_body=T0, stop_sequences=["never!"])
    assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None


def test_thinking_block(server):
    """thinking {type: enabled, budget_tokens}: the reasoning comes as a thinking block (with a
    signature) before the text, streamed as thinking_delta then signature_delta; disabled: no
    thinking block. Mutation: not passing budget_tokens as the reasoning budget fails it (all
    thinking, no text)."""
    c = client(server)
    kw = dict(model="thinker", max_tokens=24, messages=HELLO, extra_body=T0)  # 4 thinking, the close, text
    r = c.messages.create(thinking={"type": "enabled", "budget_tokens": 4}, **kw)
    assert [b.type for b in r.content] == ["thinking", "text"], r
    assert r.content[0].thinking and r.content[0].signature == "" and r.content[1].text
    with c.messages.stream(thinking={"type": "enabled", "budget_tokens": 4}, **kw) as st:
        events = list(st)
        final = st.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and deltas[-1] == "text_delta"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content]
    off = c.messages.create(thinking={"type": "disabled"}, **kw)
    assert [b.type for b in off.content] == ["text"]
    # the thinking block goes back with the turn (the SDK's multi-turn way) and is taken
    back = HELLO + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                    {"role": "user", "content": "and then?"}]
    assert c.messages.create(model="thinker", max_tokens=2, messages=back).usage.input_tokens > 0


def test_key_as_x_api_key(server):
    """The key is taken as x-api-key (as Claude Code and the older clients send it) or as a bearer
    token (this client's api_key and auth_token); a missing or wrong one is a 401
    authentication_error. Mutation: check_key reading only Authorization fails it."""
    as_header = anthropic.Anthropic(base_url=server, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0)
    assert as_header.messages.create(model="tiny", max_tokens=1, messages=HELLO).usage.output_tokens == 1
    assert client(server).messages.create(model="tiny", max_tokens=1, messages=HELLO).usage.output_tokens == 1
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, api_key=None, max_retries=0, timeout=60)
    assert bearer.messages.create(model="tiny", max_tokens=1, messages=HELLO).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, api_key="wrong").messages.create(model="tiny", max_tokens=1, messages=HELLO)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/messages", json=dict(model="tiny", max_tokens=1, messages=HELLO),
                   headers={"anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"


def test_errors_in_anthropics_shape(server):
    """An unknown model is a 404 not_found_error; a missing max_tokens, a bad block and an image
    the model cannot take are 400 invalid_request_error, with Anthropic's error JSON. Mutation:
    leaving AnthropicErrors out of the app fails it (OpenAI's shape comes back)."""
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="nope", messages=HELLO)
    r = httpx.post(server + "/v1/messages", json=dict(model="tiny", messages=HELLO),
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=4, messages=[])
    assert "at least one message" in e.value.body["error"]["message"]
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
    for block, says in (({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}, "mmproj"),
                        ({"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}, "data: URL"),
                        ({"type": "document", "source": {}}, "'document'")):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [block]}])
        assert e.value.body["error"]["type"] == "invalid_request_error" and says in e.value.body["error"]["message"]


@pytest.fixture(scope="module")
def vision_server():
    pytest.importorskip("PIL.Image")
    with live_server(f"see={VISION}", "--api-key", KEY, "--n-ctx", "512") as url:
        yield url


def test_image_blocks_as_chat_completions_images(vision_server):
    """A base64 image block reaches the model as the same image_url part does on chat completions
    (same text and input_tokens, greedy; count_tokens counts its rows); a url source is refused
    where the server allows no remote media. Mutation: dropping image blocks from the
    translation fails it (input_tokens)."""
    c, img = client(vision_server), png(seed=3)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(img).decode()}}
    msgs = [{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]
    r = c.messages.create(model="see", max_tokens=6, messages=msgs, extra_body=T0)
    o = openai.OpenAI(base_url=vision_server + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="see", max_tokens=6, messages=ask({"type": "image_url", "image_url": {"url": data_url(img)}}), extra_body=T0)
    assert r.content[0].text == o.choices[0].message.content and r.usage.input_tokens == o.usage.prompt_tokens
    assert c.messages.count_tokens(model="see", messages=msgs).input_tokens == r.usage.input_tokens
    text_only = c.messages.count_tokens(model="see", messages=[{"role": "user", "content": "What is this?"}])
    assert r.usage.input_tokens >= text_only.input_tokens + N_IMAGE
    remote = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="see", max_tokens=4, messages=[{"role": "user", "content": [remote]}])
    assert "remote" in e.value.body["error"]["message"]


# ---- the real model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_server(qwen2_path):
    with live_server(f"qwen={qwen2_path}", "--api-key", KEY, "--n-ctx", "2048") as url:
        yield url


def test_qwen_plain_and_forced_tool(qwen_server):
    """Qwen2.5-Coder-0.5B answers a plain question, and a forced get_weather call names Paris; its
    tool_result goes back into the prompt (counted: the result's tokens more than an empty one;
    the 0.5B model itself only repeats the call after it, so no reply is asserted). Mutation:
    tool_use input sent as the raw arguments string (not parsed) fails it."""
    c = client(qwen_server)
    r = c.messages.create(model="qwen", max_tokens=12, extra_body=T0, system="Answer in one short sentence.",
                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.content[0].text and r.stop_reason in ("end_turn", "max_tokens"), r
    t = c.messages.create(model="qwen", max_tokens=48, extra_body=T0, messages=Q, tools=[WEATHER], tool_choice=FORCE)
    use = t.content[-1]
    assert t.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather", t
    assert isinstance(use.input, dict) and use.input["city"].lower() == "paris"
    jsonschema.validate(use.input, WEATHER_PARAMS)

    def counted(result: str) -> int:
        msgs = Q + [{"role": "assistant", "content": [b.model_dump() for b in t.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
        return c.messages.count_tokens(model="qwen", messages=msgs, tools=[WEATHER]).input_tokens
    assert counted("18 C, sunny, light wind") - counted("") >= 5
