"""OpenAI's Responses API of `hearthlm serve` (/v1/responses) through the official openai client
against a live server on 127.0.0.1: tiny synthetic models (one plain, one whose template thinks,
one whose template names tools) for the protocol (plain, streamed events, multi-turn by
previous_response_id and by items, a tool round trip, json_schema, reasoning, the store, errors),
and one plain and one tool round on Qwen2.5-Coder-0.5B."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_util import live_server  # noqa: E402
from test_reasoning import OPENS  # noqa: E402
from test_server_ollama import SCHEMA, WEATHER_PARAMS  # noqa: E402
from test_server_vision import VISION, data_url, png  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

from hearthlm.core.errors import HearthError  # noqa: E402
from hearthlm.serve.responses import Output, Store  # noqa: E402
from hearthlm.types import Chunk  # noqa: E402

KEY = "sk-responses-test"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMS}
FORCED = {"type": "function", "name": "get_weather"}
# short (the tiny model's context is 512 byte-level tokens), and it renders the calls and results
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                  "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}"
                  "{% endfor %}{% if m.tool_call_id %} <for {{ m.tool_call_id }}>{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("responses")
    paths = {"tiny": write_tiny(d / "tiny.gguf"), "thinker": write_tiny(d / "thinker.gguf", chat_template=OPENS),
             "tooler": write_tiny(d / "tooler.gguf", chat_template=TOOLS_TEMPLATE)}
    paths["see"] = VISION  # the tiny Gemma 3 vision model, its mmproj beside it
    with live_server(*(f"{n}={p}" for n, p in paths.items()), "--api-key", KEY, "--n-ctx", "512") as url:
        yield url


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_plain_and_stored(server):
    """Mutation: usage.input_tokens left at 0 (the chunks' prompt_tokens not read), a cut answer
    reported "completed", or the router included without the AUTH dependency fails it."""
    c = client(server)
    r = c.responses.create(model="tiny", input="hello there", instructions="be brief", max_output_tokens=12,
                           temperature=0)
    assert r.object == "response" and r.model == "tiny" and r.instructions == "be brief"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant" and r.output_text
    u = r.usage
    assert u.input_tokens > 5 and 0 < u.output_tokens <= 12 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # the random weights run to the limit: OpenAI's "incomplete" with its reason
    assert u.output_tokens == 12 and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    again = c.responses.create(model="tiny", input="hello there", instructions="be brief", max_output_tokens=12,
                               temperature=0)
    assert again.id != r.id and again.output_text == r.output_text  # greedy
    # the key guards these routes as it does chat's
    assert httpx.get(f"{server}/v1/responses/{r.id}", timeout=10).status_code == 401


def test_stream_events(server):
    """Mutation: dropping response.content_part.added (its line in Output._open), numbering the
    events from 1, sending the cumulative text as each delta, or an empty text in
    response.output_text.done fails it."""
    c = client(server)
    plain = c.responses.create(model="tiny", input="stream me", max_output_tokens=10, temperature=0)
    events = list(c.responses.create(model="tiny", input="stream me", max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    n_delta = kinds.count("response.output_text.delta")
    assert n_delta >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n_delta + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == plain.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and final.output[0].id == item_id
    assert final.usage.output_tokens == 10 and c.responses.retrieve(final.id).output_text == text


def test_multi_turn_by_id_and_by_items(server):
    """Mutation: carrying the earlier response's instructions into the next (system kept in the
    stored history), or dropping the earlier answer from it, fails it (the two prompts differ)."""
    c = client(server)
    kw = dict(model="tiny", max_output_tokens=8, temperature=0)
    r1 = c.responses.create(input="first question", instructions="you are terse", **kw)
    r2 = c.responses.create(input="and the second?", previous_response_id=r1.id, **kw)
    assert r2.previous_response_id == r1.id
    # the same conversation given as items (instructions are not carried over, as OpenAI has it)
    items = [{"role": "user", "content": "first question"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r1.output_text}]},
             {"role": "user", "content": [{"type": "input_text", "text": "and the second?"}]}]
    r3 = c.responses.create(input=items, **kw)
    assert r3.usage.input_tokens == r2.usage.input_tokens > r1.usage.input_tokens
    assert r3.output_text == r2.output_text
    # a chain of three: r2's history holds r1's turn too
    r4 = c.responses.create(input="third", previous_response_id=r2.id, **kw)
    r5 = c.responses.create(input=items + [{"role": "assistant", "content": r2.output_text},
                                           {"role": "user", "content": "third"}], **kw)
    assert r4.usage.input_tokens == r5.usage.input_tokens and r4.output_text == r5.output_text


def test_tool_round_trip(server):
    """Mutation: the function_call_output made a user turn (not a tool turn with its call_id), or
    the function_call item left out of the assistant turn, fails it (the chat route's prompt
    differs); the stored answer's call left out of its history (Output.history) fails the
    by-id round; the flat tool shape passed through unconverted fails the call; a call's
    output_item.done under another item id than its .added fails the client's stream helper."""
    c = client(server)
    kw = dict(model="tooler", tools=[WEATHER], temperature=0)
    r = c.responses.create(input="weather in Paris?", tool_choice=FORCED, max_output_tokens=200, **kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    # streamed: the same call, its arguments as a delta and in .done
    ev = list(c.responses.create(input="weather in Paris?", tool_choice=FORCED, max_output_tokens=200, stream=True, **kw))
    kinds = [e.type for e in ev]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert ev[-4].delta == ev[-3].arguments == call.arguments and ev[-1].response.output[0].name == "get_weather"
    # the client's own accumulating stream helper builds the same call from the events
    with c.responses.stream(input="weather in Paris?", tool_choice=FORCED, max_output_tokens=200, **kw) as s:
        list(s)
        assert s.get_final_response().output[0].arguments == call.arguments
    # the result fed back: by previous_response_id and by items, the same prompt; the answer is text
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}
    by_id = c.responses.create(input=[result], previous_response_id=r.id, max_output_tokens=6, **kw)
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, result]
    by_items = c.responses.create(input=items, max_output_tokens=6, **kw)
    assert by_id.output[0].type == "message" and by_id.output_text == by_items.output_text
    assert by_id.usage.input_tokens == by_items.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    # and the same conversation in chat completions' shape: the same prompt, the same answer
    chat = c.chat.completions.create(model="tooler", temperature=0, max_tokens=6, tools=[{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 18}'}])
    assert chat.usage.prompt_tokens == by_items.usage.input_tokens and chat.choices[0].message.content == by_items.output_text


def test_input_image_as_chat_image_url(server):
    """An input_image part is the chat route's image_url part: the same prompt (image rows
    included) and the same greedy answer.
    Mutation: dropping input_image parts (_content skipping them) fails it."""
    c = client(server)
    url = data_url(png(seed=1))
    r = c.responses.create(model="see", max_output_tokens=6, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is this?"}]}])
    chat = c.chat.completions.create(model="see", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens > 18 and r.output_text == chat.choices[0].message.content


def test_json_schema_and_json_object(server):
    """Mutation: dropping text.format (response_format() returning None) fails it: the random
    weights write no JSON of their own."""
    c = client(server)
    fmt = {"type": "json_schema", "name": "reply", "schema": SCHEMA, "strict": True}
    r = c.responses.create(model="tiny", input="give json", text={"format": fmt}, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    with c.responses.stream(model="tiny", input="give json", text={"format": fmt}, max_output_tokens=60,
                            temperature=0) as s:  # the client's accumulating helper
        list(s)
        assert s.get_final_response().output_text == r.output_text
    r = c.responses.create(model="tiny", input="give json", text={"format": {"type": "json_object"}},
                           max_output_tokens=32, temperature=0)
    # random weights may go on listing keys: an object is begun, and whole if it ended
    assert r.output_text.startswith("{") and (r.status == "incomplete" or isinstance(json.loads(r.output_text), dict))


def test_reasoning_item(server):
    """Mutation: mapping every effort to no budget (EFFORT_BUDGET "minimal" -> None) fails the
    minimal round; sending the thinking as output_text fails the high one."""
    c = client(server)
    r = c.responses.create(model="thinker", input="think", reasoning={"effort": "high"}, max_output_tokens=10,
                           temperature=0)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 10
    ev = list(c.responses.create(model="thinker", input="think", reasoning={"effort": "high"}, max_output_tokens=10,
                                 temperature=0, stream=True))
    assert "".join(e.delta for e in ev if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    # minimal: a budget of 0, the thinking closed in the prompt; the answer is all text
    m = c.responses.create(model="thinker", input="think", reasoning={"effort": "minimal"}, max_output_tokens=10,
                           temperature=0)
    assert [o.type for o in m.output] == ["message"] and m.usage.output_tokens_details.reasoning_tokens == 0


def test_store_get_delete_and_404s(server):
    """Mutation: keeping store=false responses (keep() without its `if body.store`) fails it;
    DELETE that leaves the response in the store fails it."""
    c = client(server)
    kw = dict(model="tiny", input="hi", max_output_tokens=2, temperature=0)
    r = c.responses.create(store=False, **kw)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(r.id)
    assert e.value.status_code == 404 and e.value.body["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(previous_response_id=r.id, **kw)
    assert e.value.body["param"] == "previous_response_id" and r.id in e.value.body["message"]
    kept = c.responses.create(**kw)
    assert c.responses.retrieve(kept.id).id == kept.id
    assert c.responses.delete(kept.id) is None  # the client returns nothing; 200 it checks
    for call in (lambda: c.responses.retrieve(kept.id), lambda: c.responses.delete(kept.id),
                 lambda: c.responses.retrieve("resp-nope")):
        with pytest.raises(openai.NotFoundError):
            call()


def test_bad_input_is_400_naming_the_field(server):
    """Mutation: letting unknown item types through (chat_messages's last branch removed) fails
    it; so does building the image part without request_images's check."""
    c = client(server)
    cases = [(dict(input=[{"type": "bogus_item"}]), "input[0].type"),
             (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
             (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "/etc/passwd"}]}]),
              "input[0].content"),
             (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
             (dict(input="x", text={"format": {"type": "yaml"}}), "text.format.type"),
             (dict(input="x", reasoning={"effort": "extreme"}), "reasoning.effort"),
             (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="tiny", max_output_tokens=2, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        assert e.value.body["type"] == "invalid_request_error" and param in e.value.body["message"]
    # a body the model refuses (pydantic): input must be a string or a list
    r = httpx.post(server + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=10,
                   json={"model": "tiny", "input": 5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input")


def test_output_items_in_turn_and_failure():
    """Thinking, then text, then a call, as one stream: three items with their own indices and
    ids, usage counting the thinking's tokens; an engine error after the start is response.failed.
    Mutation: output_index taken as 0 for every item (len(self.items) - 1 -> 0 in _delta), or
    reasoning tokens counted from every chunk, fails it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    out = Output({"id": "resp-x", "output": []})
    ev = out.start()
    ev += out.feed(Chunk("", [1, 2], reasoning="hmm"))
    ev += out.feed(Chunk("Hi", [3]))
    ev += out.feed(Chunk(" there", [4], finish_reason="tool_calls", prompt_tokens=9, tool_calls=[call]))
    kinds = [(e["type"], e.get("output_index")) for e in ev]
    assert kinds == [("response.created", None), ("response.in_progress", None),
                     ("response.output_item.added", 0), ("response.content_part.added", 0),
                     ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0),
                     ("response.content_part.done", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.content_part.added", 1),
                     ("response.output_text.delta", 1), ("response.output_text.delta", 1),
                     ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
                     ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
                     ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
                     ("response.completed", None)]
    r = ev[-1]["response"]
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][1]["content"][0]["text"] == "Hi there" and r["output"][2]["call_id"] == "call_1"
    assert r["usage"] == dict(input_tokens=9, input_tokens_details=dict(cached_tokens=0), output_tokens=4,
                              output_tokens_details=dict(reasoning_tokens=2), total_tokens=13)
    assert out.history() == [{"role": "assistant", "content": "Hi there", "tool_calls": [call]}]
    failed = Output({"id": "resp-y", "output": []})
    failed.start()
    failed.feed(Chunk("a", [1]))
    (e,) = failed.failed(HearthError("the engine stopped"))
    assert e["type"] == "response.failed" and e["sequence_number"] == 5
    assert e["response"]["status"] == "failed" and e["response"]["error"]["message"] == "the engine stopped"


def test_store_evicts_the_oldest():
    """By count and by bytes, the newest kept even alone over the limit.
    Mutation: popitem(last=True) (the newest evicted), or the byte count not lowered on eviction
    or on delete, fails it."""
    s = Store(size=2)
    for i in range(3):
        s.put({"id": f"r{i}"}, [])
    assert list(s.kept) == ["r1", "r2"]
    with pytest.raises(Exception, match="r0"):
        s.get("r0")
    s = Store(size=100, max_bytes=1000)
    s.put({"id": "a"}, [{"role": "user", "content": "x" * 400}])
    s.put({"id": "b"}, [{"role": "user", "content": "y" * 400}])
    assert list(s.kept) == ["a", "b"]
    s.put({"id": "c"}, [{"role": "user", "content": "z" * 400}])
    assert list(s.kept) == ["b", "c"]
    s.delete("b")
    s.put({"id": "d"}, [{"role": "user", "content": "w" * 400}])
    assert list(s.kept) == ["c", "d"] and s.get("d")[1][0]["content"] == "w" * 400
    s.put({"id": "big"}, [{"role": "user", "content": "v" * 5000}])
    assert list(s.kept) == ["big"] and s.bytes > 1000


# ---- the real model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_server(qwen2_path):
    with live_server(f"qwen={qwen2_path}", "--n-ctx", "2048", timeout=300) as url:
        yield url


def test_qwen_plain_and_tool_round(qwen_server):
    """Qwen2.5-Coder-0.5B-Instruct, greedy: a plain answer with code in it; a forced get_weather
    call for Paris; its result fed back by previous_response_id gets a text answer carrying it (the
    0.5B model restates the call and the result, as it does through the chat route).
    Mutation: the result fed back as a user turn (chat_messages's function_call_output branch
    making role "user") fails it: the model calls the tool again, with no 18 in it."""
    c = openai.OpenAI(base_url=qwen_server + "/v1", api_key="none", max_retries=0, timeout=300)
    r = c.responses.create(model="qwen", input="Write a Python function that reverses a string.",
                           max_output_tokens=40, temperature=0)
    assert "def reverse_string" in r.output_text and "<|im_" not in r.output_text
    tools = [dict(WEATHER, parameters=dict(WEATHER_PARAMS, properties=dict(WEATHER_PARAMS["properties"],
                                                                           city={"type": "string", "maxLength": 30})))]
    r = c.responses.create(model="qwen", input="What's the weather in Paris?", tools=tools, tool_choice=FORCED,
                           max_output_tokens=96, temperature=0)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] == "Paris"
    out = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": "18 C", "sky": "sunny"}'}
    a = c.responses.create(model="qwen", input=[out], previous_response_id=r.id, tools=tools, max_output_tokens=48,
                           temperature=0)
    assert a.output[-1].type == "message" and "18" in a.output_text, a.output_text
