"""Session.act, the tool loop (issue #41 part 3): tool schemas from callables, calls and their
results fed back, failures reported to the model, max_rounds, act_stream's events, and an MCP
server's tools (tests/mcp_server.py as a real subprocess). On the tiny synthetic model, whose
first round is a forced call (constrained, as tests/test_tool_calls.py forces them); later
rounds are "auto" and it answers in random text."""
from __future__ import annotations

import enum
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import anyio
import pytest

import hearthlm.mcp as hmcp
from hearthlm import InvalidRequestError, Session
from hearthlm.act import Done, TextDelta, Tool, ToolCall, ToolResult, as_tools, run_call, tool
from hearthlm.tool_schema import check_arguments, function_schema

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny  # noqa: E402

SERVER = str(Path(__file__).parent / "mcp_server.py")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GEN = dict(max_tokens=64, temperature=0)  # room for a forced call (byte tokens)


class Opaque:
    pass


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def weather(city: Literal["Paris", "Oslo"], unit: Unit = Unit.C) -> dict:
    """Get the weather in a city.

    Say which unit.

    Args:
        city: The city's name.
        unit (Unit): Celsius or
            fahrenheit.
    """
    weather.calls.append((city, unit))
    return {"city": city, "temp": 18 if unit is Unit.C else 64}


async def clock(zone: Literal["CET", "UTC"]) -> str:
    """The time in a zone."""
    await anyio.sleep(0)
    clock.calls.append(zone)
    return f"12:00 {zone}"


def broken(why: Literal["x"]) -> str:
    """Fails."""
    raise ValueError("the weather service is down")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("act") / "tiny.gguf", context_length=4096))


@pytest.fixture
async def session(tiny):
    weather.calls, clock.calls = [], []
    async with Session.open(tiny, n_ctx=4096) as s:
        yield s


def spy_prompts(s: Session) -> list[str]:
    """The text of every prompt the session renders, in order."""
    seen, real = [], s._prompt_ids

    def spy(*a, **kw):
        ids = real(*a, **kw)
        seen.append(s.detokenize(ids))
        return ids
    s._prompt_ids = spy
    return seen


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_schema_from_hints_and_docstring():
    """Mutation: dropping the `default -> not required` rule, or reading the first paragraph
    past its blank line, or the Google continuation line, fails it."""
    assert function_schema(weather) == {"type": "function", "function": {
        "name": "weather", "description": "Get the weather in a city.", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["city"], "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"], "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Celsius or fahrenheit."}}}}}

    def search(query: str, limit: int = 5, tags: list[str] | None = None, weights: dict[str, float] = None,
               exact: bool = False, note: Annotated[Optional[str], "a note"] = None, *args, **kw: Any) -> list:
        """Search the index.

        Parameters
        ----------
        query : str
            What to look for,
            in words.
        limit : int
            At most this many.

        Returns
        -------
        list
        """
    assert function_schema(search)["function"] == {
        "name": "search", "description": "Search the index.", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["query"], "properties": {
                "query": {"type": "string", "description": "What to look for, in words."},
                "limit": {"type": "integer", "description": "At most this many."},
                "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                "exact": {"type": "boolean"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "a note"}}}}

    def bad(x: Opaque) -> None:
        pass
    with pytest.raises(InvalidRequestError, match="bad: parameter 'x'"):
        function_schema(bad)


def test_tools_in_every_shape():
    """Mutation: as_tools ignoring a pair's spec (deriving it from the callable) fails it."""
    spec = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    ts = as_tools([weather, tool(clock, timeout=2), (spec, lambda: "x")])
    assert [t.name for t in ts] == ["weather", "clock", "lookup"] and ts[1].timeout == 2 and ts[2].spec == spec
    for bad, problem in [([], "tools="), ([42], r"tools\[0\]"), ([weather, weather], "must differ")]:
        with pytest.raises(InvalidRequestError, match=problem):
            as_tools(bad)


async def test_run_call_reports_failures():
    """Each failure becomes (an "Error: ..." text, True), never an exception. Mutation: letting
    the JSON error or the non-JSON result through (raising), or skipping the schema check, fails it."""
    w, b = tool(weather), tool(broken)
    weather.calls = []

    async def run(t, args, timeout=None):
        return await run_call(t, {"function": {"name": t.name if t else "nope", "arguments": args}}, timeout)
    assert await run(w, '{"city": "Oslo", "unit": "fahrenheit"}') == ('{"city": "Oslo", "temp": 64}', False)
    assert weather.calls == [("Oslo", Unit.F)]  # the Enum member, not its value
    assert await run(w, '{"city": "Oslo"') == ("Error: the arguments are not JSON (Expecting ',' delimiter: "
                                               "line 1 column 16 (char 15))", True)
    assert await run(w, '{"city": "Rome"}') == ("Error: arguments.city must be one of ['Paris', 'Oslo'], got 'Rome'", True)
    assert await run(w, '{"unit": "celsius"}') == ("Error: arguments lacks the required 'city'", True)
    assert await run(w, '{"city": "Oslo", "when": 1}') == ("Error: arguments has no parameter 'when' (it takes city, unit)", True)
    assert await run(b, '{"why": "x"}') == ("Error: ValueError: the weather service is down", True)
    assert await run(None, "{}") == ("Error: there is no tool named 'nope'", True)
    odd = tool(lambda: {1, 2}, name="odd")
    content, err = await run(odd, "{}")
    assert err and content.startswith("Error: the tool odd returned a set that JSON cannot hold")
    assert check_arguments([1, "a"], {"type": "array", "items": {"type": "integer"}}) == \
        "arguments[1] must be integer, got str 'a'"
    assert check_arguments(True, {"type": "integer"}) is not None  # JSON's true is no integer


async def test_timeouts():
    """A sync tool stuck in its thread and an async one are both cut off at their timeout.
    Mutation: abandon_on_cancel=False (the thread is then waited for) fails it."""
    release = threading.Event()
    stuck = tool(lambda: release.wait(10), name="stuck", timeout=0.2)

    async def slow() -> str:
        await anyio.sleep(10)
    t0 = time.monotonic()
    try:
        assert await run_call(stuck, {"function": {"name": "stuck", "arguments": "{}"}}, None) == \
            ("Error: the tool stuck timed out after 0.2 s", True)
        assert await run_call(tool(slow), {"function": {"name": "slow", "arguments": "{}"}}, 0.1) == \
            ("Error: the tool slow timed out after 0.1 s", True)
    finally:
        release.set()
    assert time.monotonic() - t0 < 3


async def test_act_calls_sync_and_async_tools(session):
    """Round 1 forced (named), its call run with the model's arguments, the result in round 2's
    prompt, then a plain answer. Mutation: not appending the tool turn (round 2 without the
    result), or keeping tool_choice forced after round 1 (round 2 calls again), fails it."""
    prompts = spy_prompts(session)
    done = await session.act(messages=ASK, tools=[weather, clock], tool_choice=named("weather"), **GEN)
    call = done.messages[1]["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    assert weather.calls == [(args["city"], Unit(args.get("unit", "celsius")))]
    result = json.dumps(weather(args["city"], Unit(args.get("unit", "celsius"))))
    assert [m["role"] for m in done.messages] == ["user", "assistant", "tool", "assistant"]
    assert done.messages[0] == ASK[0] and done.messages[1]["content"] is None
    assert done.messages[2] == {"role": "tool", "tool_call_id": call["id"], "name": "weather", "content": result}
    assert done.messages[3] == {"role": "assistant", "content": done.text}
    assert done.finish_reason in ("stop", "length") and done.tool_calls is None
    assert len(prompts) == 2 and result not in prompts[0]
    assert f"<tool_response>\n{result}\n</tool_response>" in prompts[1]
    assert ASK == [{"role": "user", "content": "What is the weather in Paris?"}]  # the caller's list untouched

    done = await session.act(messages=ASK, tools=[weather, clock], tool_choice=named("clock"), **GEN)
    zone = json.loads(done.messages[1]["tool_calls"][0]["function"]["arguments"])["zone"]
    assert clock.calls == [zone] and done.messages[2]["content"] == f"12:00 {zone}"


async def test_raising_tool_and_max_rounds(session):
    """A raising tool's error goes to the model and act returns; max_rounds=1 stops after the
    first round's calls with finish_reason "max_rounds". Mutation: re-raising the tool's
    exception, or returning "tool_calls" at the limit, fails it."""
    done = await session.act(messages=ASK, tools=[broken], tool_choice="required", **GEN)
    assert done.messages[2]["content"] == "Error: ValueError: the weather service is down"
    assert done.messages[-1]["role"] == "assistant"
    done = await session.act(messages=ASK, tools=[weather], tool_choice="required", max_rounds=1, **GEN)
    assert done.finish_reason == "max_rounds" and done.tool_calls
    assert [m["role"] for m in done.messages] == ["user", "assistant", "tool"]  # go on with act(messages=...)
    with pytest.raises(InvalidRequestError, match="max_rounds"):
        await session.act(messages=ASK, tools=[weather], max_rounds=0)


def test_sync_session_act(tiny):
    """SyncSession.act runs the loop from plain code. Mutation: SyncSession.act calling
    generate instead (no tool run) fails it."""
    from hearthlm import SyncSession
    clock.calls = []
    with SyncSession(tiny, n_ctx=4096) as s:
        done = s.act(messages=ASK, tools=[clock], tool_choice="required", **GEN)
    assert len(clock.calls) == 1 and done.messages[2]["content"] == f"12:00 {clock.calls[0]}"


async def test_act_stream_events(session):
    """Order: the forced round's ToolCall then its ToolResult, then the answer's TextDeltas,
    then Done. Mutation: dropping the ToolCall events (the results come first) fails it."""
    events = [e async for e in session.act_stream(messages=ASK, tools=[clock], tool_choice="required", **GEN)]
    kinds = [type(e).__name__ for e in events]
    assert kinds[:2] == ["ToolCall", "ToolResult"] and kinds[-1] == "Done"
    assert set(kinds[2:-1]) <= {"TextDelta"}
    call, res, done = events[0], events[1], events[-1]
    assert isinstance(call, ToolCall) and isinstance(res, ToolResult) and isinstance(done, Done)
    assert call.name == res.name == "clock" and call.id == res.id and call.round == res.round == 0
    assert res.content == "12:00 " + json.loads(call.arguments)["zone"] and not res.is_error
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.completion.text
    assert all(e.round == 1 for e in events if isinstance(e, TextDelta))


async def test_mcp_stdio_server(session):
    """The server's tools over stdio: their inputSchema as the schema, act calling one, an
    isError result reported as an error. Mutation: ignoring is_error (the text as a result)
    fails it."""
    async with hmcp.stdio_tools([sys.executable, SERVER]) as tools:
        assert isinstance(tools[0], Tool) and [t.name for t in tools] == ["lookup", "fail"]
        assert tools[0].parameters["properties"]["key"]["enum"] == ["a", "b"]
        done = await session.act(messages=ASK, tools=tools, tool_choice=named("lookup"), **GEN)
        key = json.loads(done.messages[1]["tool_calls"][0]["function"]["arguments"])["key"]
        assert done.messages[2]["content"] == {"a": "apple", "b": "banana"}[key]
        content, err = await run_call(tools[1], {"function": {"name": "fail", "arguments": '{"reason": "no"}'}}, None)
        assert err and content.startswith("Error: ") and "failed on purpose: no" in content


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_mcp_http_server():
    """The same server over streamable HTTP, with a header passed (not checked server-side).
    Mutation: http_tools connecting elsewhere than the URL given (url + "x") fails it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # up in a few seconds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                await anyio.sleep(0.1)
        async with hmcp.http_tools(f"http://127.0.0.1:{port}/mcp", headers={"X-Test": "1"}) as tools:
            lookup = next(t for t in tools if t.name == "lookup")
            assert await run_call(lookup, {"function": {"name": "lookup", "arguments": '{"key": "b"}'}}, None) == \
                ("banana", False)
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_extra_named_when_missing(monkeypatch):
    """hearthlm.mcp imports without `mcp`; using it names the extra. Mutation: importing mcp at
    hearthlm.mcp's top fails it."""
    out = subprocess.run([sys.executable, "-c", "import sys; sys.modules['mcp'] = None; import hearthlm, hearthlm.mcp"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ImportError, match=r"hearthlm\[mcp\]"):
        hmcp._sdk()


async def test_act_qwen_calls_by_itself(qwen2_path):
    """Qwen2.5-Coder-0.5B under "auto" (greedy): it calls the tool by itself with the right
    argument, and round 2's prompt carries the result in Qwen's own <tool_response> turn. (This
    0.5B model then writes its call again as bare JSON text rather than answering from the
    result, whatever the system prompt: a model limit, not asserted.) Mutation: not appending
    the tool turn (no <tool_response> in round 2) fails it."""
    seen = []

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "18 C, sunny"
    async with Session.open(str(qwen2_path), n_ctx=2048) as s:
        prompts = spy_prompts(s)
        done = await s.act(messages=ASK, tools=[get_weather], max_tokens=32, temperature=0)
    assert seen == ["Paris"], done.messages
    assert [m["role"] for m in done.messages] == ["user", "assistant", "tool", "assistant"]
    assert len(prompts) == 2 and "<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompts[1]
