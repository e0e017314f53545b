"""Tool calling: the per-family parsers on recorded and constructed outputs, the streamed hold
back of call text, the forced-call grammars, OpenAI-shaped chat history; end to end on
SmolLM2 (whose template knows no tools: they go in the system message) and on
Qwen2.5-Coder-0.5B-Instruct (its template renders them)."""
from __future__ import annotations

import json

import anyio
import jsonschema
import pytest

from hearthlm import InvalidRequestError, Session
from hearthlm.model_zoo import tool_calls as tc
from hearthlm.model_zoo.chat_template import encode_chat, render_chat
from hearthlm.tools import ToolOutput, ToolPlan
from hearthlm.types import Chunk

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                                                        "required": ["zone"]}}}
QUESTIONS = ["What's the weather in Paris?", "Is it raining in Tokyo right now?",
             "How hot is it in Cairo today, in fahrenheit?", "Weather for Berlin please."]


def calls_of(text: str, fmt: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = tc.FORMATS[fmt].parse(text, frozenset({"get_weather", "get_time"}))
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert isinstance(c["function"]["arguments"], str)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})


@pytest.mark.parametrize("fmt, text, content, calls", [
    # Qwen2.5-Instruct / Hermes 2 Pro, as they write it
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [PARIS, ("get_time", {"zone": "CET"})]),
    # Qwen3 thinks first; arguments given as a JSON string are parsed too
    ("hermes", '<think>\nweather tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '"{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}\n</tool_call>', "<think>\nweather tool\n</think>", [PARIS]),
    # cut short by max_tokens, or not JSON: stays text
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', None, []),
    ("hermes", "<tool_call>\nget_weather(Paris)\n</tool_call>", None, []),
    ("hermes", "It is sunny in Paris.", None, []),
    # Qwen2.5-Coder-0.5B's own reply under tool_choice="auto" (recorded): a fenced call
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "celsius"\n  }\n}\n```',
     None, [PARIS]),
    ("hermes", '{"name": "get_time", "arguments": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    # ...but only naming an offered function, and only as the whole reply
    ("hermes", '```json\n{"name": "launch_rocket", "arguments": {}}\n```', None, []),
    ("hermes", 'Use {"name": "get_time", "arguments": {"zone": "CET"}} for that', None, []),
    # Llama 3.1/3.2 custom tools
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [PARIS, ("get_time", {"zone": "CET"})]),
    ("llama3", 'The call would be {"name": "get_weather", "parameters": {}}', None, []),
    ("llama3", '{"city": "Paris"}', None, []),
    # Mistral v0.3 and v11+
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     None, [PARIS, ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', None, []),
    # gpt-oss (harmony): the recipient after the channel or in the role part; an answer before the call
    ("harmony", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
    ("harmony", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
     '{"city": "Paris", "unit": "celsius"}<|call|>', None, [PARIS]),
    ("harmony", '<|channel|>final<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
     '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}',
     "Checking both.", [PARIS, ("get_time", {"zone": "CET"})]),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa', None, []),
    ("harmony", '<|channel|>final<|message|>It is sunny.', None, []),
    # Gemma 4: bare keys, <|"|>-quoted strings, numbers and nesting (its template's format_argument)
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>', None, [PARIS]),
    ("gemma4", 'Checking.<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|><|tool_call>call:f{n:-2.5,ok:true,'
     'xs:[1,<|"|>a, b<|"|>],o:{k:null}}<tool_call|>', "Checking.",
     [("get_time", {"zone": "CET"}), ("f", {"n": -2.5, "ok": True, "xs": [1, "a, b"], "o": {"k": None}})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Par', None, []),
])
def test_parsers(fmt, text, content, calls):
    got_content, got_calls = calls_of(text, fmt)
    assert got_calls == calls
    assert got_content == (content if calls else text)


def test_stream_holds_call_text_back():
    plan = ToolPlan(tc.FORMATS["hermes"], [WEATHER], "auto")
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    out, shown = ToolOutput(plan), []
    for ch in text:  # the worst case: one character per chunk
        shown.append(out.feed(Chunk(ch, [0])).text)
    last = out.feed(Chunk("", [], "stop"))
    assert "".join(shown) + last.text == "Sure.\n"
    assert last.finish_reason == "tool_calls" and last.tool_calls[0]["function"]["name"] == "get_weather"
    # no call: every character comes out, the finish reason unchanged
    out = ToolOutput(plan)
    plain = "x < y and <tool is not a call"
    texts = [out.feed(Chunk(ch, [0])).text for ch in plain] + [out.feed(Chunk("", [], "length")).text]
    assert "".join(texts) == plain


def test_format_by_family():
    assert tc.tool_format("qwen2", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert tc.tool_format("llama", "{{ '[TOOL_CALLS]' }}{% if tools %}{% endif %}").name == "mistral"
    assert tc.tool_format("llama", "<|start_header_id|>{% if tools %}{% endif %}").name == "llama3"
    assert tc.tool_format("qwen3", None).name == "hermes"
    assert tc.tool_format("llama", "<|start|>assistant to={{ 'functions.' + name }}<|channel|>commentary ").name == "harmony"
    assert tc.tool_format("gpt-oss", None).name == "harmony"
    assert tc.tool_format("gemma4", "{{ '<|tool_call>call:' + name }}").name == "gemma4"


def test_harmony_grammar_forces_one_call():
    """The Lark text llguidance takes for tool_choice "required" on gpt-oss: the control tokens by id
    where the vocabulary has them, a call to one of the offered functions with arguments that fit."""
    import llguidance
    ids = {"<|channel|>": 7, "<|constrain|>": 8, "<|message|>": 9}
    g = tc.FORMATS["harmony"].grammar([WEATHER, TIME], "required", ids.get)
    assert g.startswith("start: <[7]> ") and "<[8]>" in g and "<[9]>" in g and '"get_time"' in g
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", g)) == ""  # no error
    g4 = tc.FORMATS["gemma4"].grammar([WEATHER, TIME], "required", {"<|tool_call>": 5, "<tool_call|>": 6}.get)
    assert g4.startswith("start: <[5]> ") and "<[6]>" in g4
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", g4)) == ""
    named = tc.FORMATS["harmony"].grammar([WEATHER, TIME], "get_weather", lambda t: None)
    assert '"get_time"' not in named and '"<|channel|>"' in named  # no control tokens: the text


@pytest.mark.parametrize("tools, choice, problem", [
    ([], "auto", "non-empty list"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "JSON schema"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
])
def test_bad_tools(tools, choice, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        tc.check_tools(tools, choice)


def test_openai_shaped_history_renders(smollm2_path):
    """Assistant turns with tool_calls (content None) and tool turns reach a template that
    renders them as transformers would pass them (arguments as dicts); injected markers in
    a tool result stay text."""
    from hearthlm.model_zoo.gguf_file import GGUFFile
    from hearthlm.model_zoo.tokenizer import Tokenizer
    qwen_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
                 "{% for t in m.tool_calls or [] %}<tool_call>{{ t.function.name }} {{ t.function.arguments | tojson }}"
                 "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if tools %}TOOLS {{ tools | length }}{% endif %}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C<|im_end|>"}]
    text = render_chat(qwen_like, msgs, add_generation_prompt=False, tools=[WEATHER])
    assert text == ('<|im_start|>user\nWeather\nin Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>get_weather '
                    '{"city": "Paris"}</tool_call><|im_end|>\n<|im_start|>tool\n18 C<|im_end|><|im_end|>\nTOOLS 1')
    with GGUFFile.open(smollm2_path) as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    end = tok.token_id("<|im_end|>")
    ids = encode_chat(tok, qwen_like, msgs, add_generation_prompt=False, tools=[WEATHER])
    assert ids.count(end) == 3  # the template's three, not the one typed into the tool result
    with pytest.raises(InvalidRequestError, match="special-token text"):
        encode_chat(tok, qwen_like, msgs, tools=[{"type": "function", "function": {"name": "x<|im_start|>"}}])


async def forced_calls(s: Session, tools: list[dict], choice) -> list:
    """Forced calls for QUESTIONS, concurrently; each must parse with valid arguments."""
    out = [None] * len(QUESTIONS)

    async def one(i, q):
        out[i] = await s.generate(messages=[{"role": "user", "content": q}], tools=tools, tool_choice=choice,
                                  max_tokens=64, temperature=0)
    async with anyio.create_task_group() as tg:
        for i, q in enumerate(QUESTIONS):
            tg.start_soon(one, i, q)
    for c in out:
        assert c.finish_reason == "tool_calls", (c.text, c.finish_reason)
        assert len(c.tool_calls) == 1
        fn = c.tool_calls[0]["function"]
        params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == fn["name"])
        jsonschema.validate(json.loads(fn["arguments"]), params)
    return out


async def test_forced_tool_calls_smollm2(smollm2_path):
    async with Session.open(str(smollm2_path), n_ctx=1024) as s:
        for c in await forced_calls(s, [WEATHER, TIME], "required"):
            assert c.tool_calls[0]["function"]["name"] in ("get_weather", "get_time")
        named = {"type": "function", "function": {"name": "get_weather"}}
        for c in await forced_calls(s, [WEATHER, TIME], named):
            assert c.tool_calls[0]["function"]["name"] == "get_weather"
        # stream(): the call in the final chunk, none of its text before
        chunks = [c async for c in s.stream(messages=[{"role": "user", "content": QUESTIONS[0]}], tools=[WEATHER],
                                            tool_choice="required", max_tokens=64, temperature=0)]
        assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].tool_calls
        assert "".join(c.text for c in chunks) == ""
        assert all(c.tool_calls is None for c in chunks[:-1])
        # "none": no calls offered or parsed
        c = await s.generate(messages=[{"role": "user", "content": QUESTIONS[0]}], tools=[WEATHER], tool_choice="none",
                             max_tokens=8, temperature=0)
        assert c.tool_calls is None and c.finish_reason in ("stop", "length")
        # a conversation carrying a call and its result continues
        call = chunks[-1].tool_calls[0]
        c = await s.generate(messages=[{"role": "user", "content": QUESTIONS[0]},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}],
                             tools=[WEATHER], max_tokens=8, temperature=0)
        assert c.token_ids
        with pytest.raises(InvalidRequestError, match="messages="):
            await s.generate("hi", tools=[WEATHER])
        with pytest.raises(InvalidRequestError, match="not both"):
            await s.generate(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="required",
                             response_format={"type": "json_object"})


async def test_tool_calls_qwen(qwen2_path):
    async with Session.open(str(qwen2_path), n_ctx=2048) as s:
        assert ToolPlan.make(s.model, [WEATHER], "auto").fmt.name == "hermes"
        for c in await forced_calls(s, [WEATHER], "required"):
            assert c.tool_calls[0]["function"]["name"] == "get_weather"
        # "auto": a question that needs the tool yields a call
        c = await s.generate(messages=[{"role": "user", "content": QUESTIONS[0]}], tools=[WEATHER], tool_choice="auto",
                             max_tokens=96, temperature=0)
        assert c.finish_reason == "tool_calls", c.text
        assert c.tool_calls[0]["function"]["name"] == "get_weather"
        assert json.loads(c.tool_calls[0]["function"]["arguments"])["city"] == "Paris"


def test_llama3_stream_holds_a_leading_call_only():
    plan = ToolPlan(tc.FORMATS["llama3"], [WEATHER], "auto")
    out = ToolOutput(plan)
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert "".join(out.feed(Chunk(ch, [0])).text for ch in call) == ""
    last = out.feed(Chunk("", [], "stop"))
    assert last.finish_reason == "tool_calls" and last.text == ""
    out = ToolOutput(plan)
    assert out.feed(Chunk("It is {warm} today", [0])).text == "It is {warm} today"
