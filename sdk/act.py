"""Session.act: the tool loop. Generate; when the model calls tools, call them, append the
assistant's calls and the tools' results (OpenAI's message shapes) and generate again, until
the model answers in text or max_rounds. A tool that fails (raises, times out, returns what
JSON cannot hold, or gets arguments that do not fit its schema) is reported to the model as
an error result, never raised to the caller."""
from __future__ import annotations

import enum
import inspect
import json
import typing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable

import anyio

from hearthlm.core.errors import InvalidRequestError
from hearthlm.output import ChunkJoin
from hearthlm.tool_schema import check_arguments, function_schema
from hearthlm.types import Completion


class ToolError(Exception):
    """Raise it from a tool to report just its message to the model (MCP's isError results)."""


@dataclass
class Tool:
    """A tool act() can call: its OpenAI-shaped spec and the callable (sync or async) that
    takes the arguments as keywords. `timeout`: seconds before the call counts as failed."""
    spec: dict
    fn: Callable[..., Any]
    timeout: float | None = None
    enums: dict[str, type] = field(default_factory=dict)  # parameters passed as Enum members

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]

    @property
    def parameters(self) -> dict:
        return self.spec["function"].get("parameters") or {"type": "object", "properties": {}}

    async def __call__(self, args: dict) -> Any:
        args = {k: self.enums[k](v) if k in self.enums else v for k, v in args.items()}
        fn = self.fn
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            return await fn(**args)
        # a sync tool runs in a worker thread so the event loop (and the engine's stream) go on
        result = await anyio.to_thread.run_sync(partial(fn, **args), abandon_on_cancel=True)
        return await result if inspect.isawaitable(result) else result  # e.g. a lambda returning a coroutine


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         timeout: float | None = None, spec: dict | None = None):
    """A Tool from a callable (usable as a decorator, with or without arguments): its schema
    derived from the type hints and docstring, or `spec` given (OpenAI's function shape)."""
    if fn is None:
        return partial(tool, name=name, description=description, timeout=timeout, spec=spec)
    if spec is None:
        spec = function_schema(fn, name)
        if description is not None:
            spec["function"]["description"] = description
        hints = typing.get_type_hints(fn)
        enums = {k: h for k, h in hints.items() if isinstance(h, type) and issubclass(h, enum.Enum)}
    else:
        fn_spec = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(fn_spec, dict) or not isinstance(fn_spec.get("name"), str):
            raise InvalidRequestError("a tool spec must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        spec, enums = {"type": "function", "function": fn_spec}, {}
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise InvalidRequestError(f"a tool's timeout must be a positive number of seconds, got {timeout!r}")
    return Tool(spec, fn, timeout, enums)


def as_tools(tools: Any) -> list[Tool]:
    """Tools from what act() takes: Tool, a callable, or a (spec dict, callable) pair."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise InvalidRequestError("act needs tools=[...]: callables, hearthlm.act.tool(...) or (spec, callable) pairs")
    out = []
    for i, t in enumerate(tools):
        if isinstance(t, Tool):
            out.append(t)
        elif isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], dict) and callable(t[1]):
            out.append(tool(t[1], spec=t[0]))
        elif callable(t):
            out.append(tool(t))
        else:
            raise InvalidRequestError(f"tools[{i}] is neither a callable, a Tool nor a (spec, callable) pair: {t!r}")
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tool names must differ: {names}")
    return out


# ---- events of act_stream ---------------------------------------------------------------
@dataclass
class TextDelta:
    text: str            # new answer text
    reasoning: str = ""  # new thinking text (templates that think)
    round: int = 0


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str       # the JSON text the model wrote
    round: int = 0


@dataclass
class ToolResult:
    id: str
    name: str
    content: str         # what the model is shown (an error's message, "Error: ..." prefixed)
    is_error: bool = False
    round: int = 0


@dataclass
class Done:
    completion: Completion  # the last round's, with .messages the whole exchange


Event = TextDelta | ToolCall | ToolResult | Done


async def run_call(t: Tool | None, call: dict, default_timeout: float | None) -> tuple[str, bool]:
    """(content, is_error) of one OpenAI-shaped call."""
    fn = call.get("function") or {}
    if t is None:
        return f"Error: there is no tool named {fn.get('name')!r}", True
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError as e:
        return f"Error: the arguments are not JSON ({e})", True
    problem = check_arguments(args, t.parameters) if isinstance(args, dict) else "the arguments must be a JSON object"
    if problem:
        return f"Error: {problem}", True
    timeout = t.timeout if t.timeout is not None else default_timeout
    try:
        with anyio.move_on_after(timeout) as scope:
            result = await t(args)
        if scope.cancelled_caught:
            return f"Error: the tool {t.name} timed out after {timeout:g} s", True
    except ToolError as e:
        return f"Error: {e}", True
    except Exception as e:  # the model is told and may try again; the caller's loop goes on
        return f"Error: {type(e).__name__}: {e}", True
    if isinstance(result, str):
        return result, False
    try:
        return json.dumps(result, ensure_ascii=False), False
    except (TypeError, ValueError) as e:
        return f"Error: the tool {t.name} returned a {type(result).__name__} that JSON cannot hold ({e})", True


async def act_stream(session, *, messages: list[dict], tools: Any, tool_choice: Any = None, max_rounds: int = 8,
                     tool_timeout: float | None = None, **kwargs) -> AsyncIterator[Event]:
    """The loop behind Session.act_stream (see there)."""
    tools = as_tools(tools)
    if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
        raise InvalidRequestError(f"max_rounds must be a positive integer, got {max_rounds!r}")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("act needs messages=[...] (OpenAI's chat shape)")
    if kwargs.get("n", 1) != 1 or "prompt" in kwargs:
        raise InvalidRequestError("act takes messages= and one choice (no prompt, no n)")
    by_name, specs = {t.name: t for t in tools}, [t.spec for t in tools]
    msgs, choice = list(messages), tool_choice
    for rnd in range(max_rounds):
        got = ChunkJoin()
        async for c in session.stream(messages=msgs, tools=specs, tool_choice=choice, **kwargs):
            got.add(c)
            if c.text or c.reasoning:
                yield TextDelta(c.text, c.reasoning, rnd)
        done = got.completion()
        if not done.tool_calls:
            done.messages = [*msgs, {"role": "assistant", "content": done.text}]
            yield Done(done)
            return
        msgs.append({"role": "assistant", "content": done.text or None, "tool_calls": done.tool_calls})
        for call in done.tool_calls:
            yield ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"], rnd)
        results = [("", False)] * len(done.tool_calls)

        async def one(i: int, call: dict) -> None:
            results[i] = await run_call(by_name.get(call["function"]["name"]), call, tool_timeout)
        async with anyio.create_task_group() as tg:  # a round's calls run together
            for i, call in enumerate(done.tool_calls):
                tg.start_soon(one, i, call)
        for call, (content, is_error) in zip(done.tool_calls, results):
            name = call["function"]["name"]
            msgs.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})
            yield ToolResult(call["id"], name, content, is_error, rnd)
        choice = None  # later rounds: "auto"
    done.finish_reason, done.messages = "max_rounds", msgs
    yield Done(done)


async def act(session, **kwargs) -> Completion:
    """The loop behind Session.act: act_stream's last event."""
    async for ev in act_stream(session, **kwargs):
        if isinstance(ev, Done):
            return ev.completion
    raise AssertionError("act_stream ended without Done")  # pragma: no cover
