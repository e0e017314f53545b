"""OpenAI's Responses API: POST /v1/responses (answered whole, or streamed as its typed events),
GET and DELETE /v1/responses/{id}. A translation over the chat route: the input items become
chat messages (images checked by request_images), the request a ChatRequest (its sampling,
tools, response_format and reasoning-budget checks), and the Session's Chunks become output
items. Responses kept (store, the default) sit in a bounded in-memory store, oldest evicted,
for GET and previous_response_id."""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from hearthlm.core.errors import HearthError
from hearthlm.serve.common import APIError, host_of, request_images, status_of, until_disconnect
from hearthlm.serve.protocol import ChatRequest, _Sampling, new_id, now

router = APIRouter()
MAX_STORED = 1024  # responses kept for GET and previous_response_id; the oldest goes first
MAX_STORED_BYTES = 256 * 2**20  # and at most this much of their JSON
# reasoning.effort -> the chat route's reasoning_budget (tokens of thinking; None: unbounded)
EFFORT_BUDGET = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": None, "xhigh": None}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


class ResponsesRequest(_Sampling):
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    metadata: dict[str, str] | None = None

    def chat_kwargs(self, tokenizer, messages: list[dict]) -> dict[str, Any]:
        """Session keyword arguments, through the chat route's ChatRequest (the same checks)."""
        if self.background:
            raise _bad("background", "background responses are not served; leave it false")
        if self.conversation is not None:
            raise _bad("conversation", "conversations are not served; use previous_response_id")
        if self.n != 1:
            raise _bad("n", "one output per response")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in EFFORT_BUDGET:
            raise _bad("reasoning.effort", f"must be one of {list(EFFORT_BUDGET)}, got {effort!r}")
        sampling = self.model_dump(include=set(_Sampling.model_fields) - {"stream", "stream_options"})
        if self.max_output_tokens is not None:
            sampling["max_tokens"] = self.max_output_tokens
        req = ChatRequest(**sampling, messages=messages, tools=chat_tools(self.tools),
                          tool_choice=chat_tool_choice(self.tool_choice), response_format=response_format(self.text),
                          reasoning_budget=EFFORT_BUDGET.get(effort),
                          # gpt-oss's templates read the level itself
                          chat_template_kwargs={"reasoning_effort": effort} if effort in ("low", "medium", "high") else None)
        return req.session_kwargs(tokenizer)


# ---- the request: Responses shapes -> chat shapes ------------------------------------------

def chat_messages(inp: str | list[Any]) -> list[dict]:
    """Chat messages from `input`: a string is one user message; items in order, a
    function_call joining the assistant turn before it, reasoning items dropped (templates
    drop an earlier turn's thinking)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    out: list[dict] = []
    for i, item in enumerate(inp):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, f"an item must be an object, not {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{at}.role", f"must be user, assistant, system or developer, got {role!r}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", at), "type": "function",
                    "function": {"name": _str(item, "name", at), "arguments": _str(item, "arguments", at)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            result = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", at),
                        "content": result if isinstance(result, str) else _content(result, f"{at}.output")})
        elif kind != "reasoning":
            raise _bad(f"{at}.type", f"unsupported item type {kind!r}; served: {', '.join(ITEM_TYPES)}")
    if not out:
        raise _bad("input", "no message in the input")
    return out


def _str(item: dict, key: str, at: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"{at}.{key}", f"must be a string, got {type(v).__name__}")
    return v


def _content(c: Any, at: str) -> str | list[dict]:
    """A message's content in chat parts: text parts as text, input_image as image_url."""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise _bad(at, "must be a string or a list of content parts")
    parts = []
    for k, p in enumerate(c):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = p.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _bad(f"{at}[{k}].text", "must be a string")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{at}[{k}].image_url", "an image is given by image_url (file_id is not served)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _bad(f"{at}[{k}].type", f"unsupported content part {kind!r}; served: input_text, input_image, output_text")
    try:
        request_images([{"content": parts}])
    except APIError as e:  # its message names a chat message; this one names the input item
        raise _bad(at, str(e).split(": ", 1)[-1]) from None
    return parts


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses' flat function tools ({type, name, parameters, ...}) in the chat shape."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}].type", f"only function tools are served, got {kind!r}")
        if isinstance(t.get("function"), dict):  # the chat shape, as some clients send it
            out.append(t)
            continue
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name", "a function tool needs a name")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name": ...}')


def response_format(text: dict | None) -> dict | None:
    """text.format in the chat route's response_format (constrained decoding)."""
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "a json_schema format needs its schema object")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise _bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


# ---- the answer: Chunks -> output items and stream events ----------------------------------

class Output:
    """Builds a response from a Session's Chunks; `feed` returns the stream events each one makes
    (a reasoning item for the thinking, a message for the text, a function_call per call)."""

    def __init__(self, response: dict) -> None:
        self.response, self.seq = response, 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item text is going to
        self.n_prompt = self.n_out = self.n_think = 0
        self.calls: list[dict] = []

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return dict(type=kind, sequence_number=self.seq - 1, **fields)

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))  # a copy: later events change it

    def feed(self, c) -> list[dict]:
        self.n_prompt = c.prompt_tokens or self.n_prompt
        self.n_out += len(c.token_ids)
        self.n_think += len(c.token_ids) if c.reasoning and not c.text else 0
        ev = self._delta("reasoning", c.reasoning) + self._delta("message", c.text)
        if c.finish_reason:
            if not self.items and not c.tool_calls:  # an empty answer is still a message
                ev += self._open("message")
            ev += self._close()
            for call in c.tool_calls or ():
                ev += self._call(call)
            ev += self._finish(c.finish_reason)
        return ev

    def _delta(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        ev = [] if self.open is not None and self.open["type"] == kind else self._close() + self._open(kind)
        part = self.open["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return ev + [self.event(name, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                                delta=text, **extra)]

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = dict(id=new_id("msg"), type="message", role="assistant", status="in_progress", content=[])
            part = dict(type="output_text", text="", annotations=[], logprobs=[])
        else:
            item = dict(id=new_id("rs"), type="reasoning", summary=[], status="in_progress", content=[])
            part = dict(type="reasoning_text", text="")
        self.items.append(item)
        self.open, at = item, dict(item_id=item["id"], output_index=len(self.items) - 1)
        ev = [self.event("response.output_item.added", output_index=at["output_index"], item=dict(item, content=[])),
              self.event("response.content_part.added", **at, content_index=0, part=dict(part))]
        item["content"].append(part)
        return ev

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        part, at = item["content"][0], dict(item_id=item["id"], output_index=self.items.index(item), content_index=0)
        done = (self.event("response.output_text.done", **at, text=part["text"], logprobs=[]) if item["type"] == "message"
                else self.event("response.reasoning_text.done", **at, text=part["text"]))
        return [done, self.event("response.content_part.done", **at, part=dict(part)),
                self.event("response.output_item.done", output_index=at["output_index"], item=json.loads(json.dumps(item)))]

    def _call(self, call: dict) -> list[dict]:
        fn = call["function"]
        item = dict(id=new_id("fc"), type="function_call", status="in_progress", call_id=call["id"], name=fn["name"],
                    arguments="")
        self.items.append(item)
        self.calls.append(call)
        at = dict(item_id=item["id"], output_index=len(self.items) - 1)
        ev = [self.event("response.output_item.added", output_index=at["output_index"], item=dict(item)),
              self.event("response.function_call_arguments.delta", **at, delta=fn["arguments"]),
              self.event("response.function_call_arguments.done", **at, arguments=fn["arguments"])]
        item.update(arguments=fn["arguments"], status="completed")
        return ev + [self.event("response.output_item.done", output_index=at["output_index"], item=dict(item))]

    def _finish(self, reason: str) -> list[dict]:
        cut = reason == "length"
        self.response.update(
            status="incomplete" if cut else "completed", output=self.items, completed_at=None if cut else now(),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage=dict(input_tokens=self.n_prompt, input_tokens_details=dict(cached_tokens=0),
                       output_tokens=self.n_out, output_tokens_details=dict(reasoning_tokens=self.n_think),
                       total_tokens=self.n_prompt + self.n_out))
        return [self.event("response.incomplete" if cut else "response.completed", response=self.snapshot())]

    def failed(self, e: HearthError) -> list[dict]:
        self.response.update(status="failed", output=self.items,
                             error=dict(code="server_error" if status_of(e)[0] >= 500 else "invalid_prompt", message=str(e)))
        return [self.event("response.failed", response=self.snapshot())]

    def history(self) -> list[dict]:
        """This answer as the chat turn a following response carries."""
        text = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "message")
        turn: dict[str, Any] = {"role": "assistant", "content": text or (None if self.calls else "")}
        if self.calls:
            turn["tool_calls"] = self.calls
        return [turn]


# ---- the store --------------------------------------------------------------------------

class Store:
    """Responses by id with the chat history that led to each (instructions left out: a
    following response brings its own), the oldest evicted past `size` responses or `max_bytes`
    of their JSON (histories carry images as data: URLs); the newest is always kept."""

    def __init__(self, size: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.size, self.max_bytes, self.kept, self.bytes = size, max_bytes, OrderedDict(), 0

    def put(self, response: dict, history: list[dict]) -> None:
        n = len(json.dumps(response)) + len(json.dumps(history))
        self.kept[response["id"]] = (response, history, n)
        self.bytes += n
        while len(self.kept) > 1 and (len(self.kept) > self.size or self.bytes > self.max_bytes):
            self.bytes -= self.kept.popitem(last=False)[1][2]

    def delete(self, rid: str) -> None:
        self.get(rid)
        self.bytes -= self.kept.pop(rid)[2]

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if rid not in self.kept:
            raise APIError(404, f"no response with id {rid!r} is stored here (store=false, evicted, deleted "
                                "or never made)", param=param)
        return self.kept[rid][:2]


def store_of(request: Request) -> Store:
    state = request.app.state
    if not hasattr(state, "responses"):
        state.responses = Store()
    return state.responses


# ---- the routes -------------------------------------------------------------------------

@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request):
    s, store = host_of(request).get(body.model), store_of(request)
    past = store.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
    turn = chat_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    kw = body.chat_kwargs(s.model.tokenizer, system + past + turn)
    out = Output(_base(body))
    stream = s.stream(messages=system + past + turn, **kw)

    def keep() -> None:
        if body.store:
            store.put(out.response, past + turn + out.history())

    async def drain() -> dict:
        async for c in stream:
            out.feed(c)
        return out.response
    if not body.stream:
        await until_disconnect(request, drain())
        keep()
        return out.response
    first = await until_disconnect(request, anext(stream))  # a request refused at submission gets its status
    metrics = request.app.state.metrics

    async def events() -> AsyncIterator[dict]:
        c = first
        try:
            for e in out.start():
                yield _sse(e)
            while True:
                for e in out.feed(c):
                    yield _sse(e)
                if c.finish_reason:
                    break
                c = await anext(stream)
            keep()
        except HearthError as e:  # mid-stream: the status is sent already
            for ev in out.failed(e):
                yield _sse(ev)
        finally:
            await stream.aclose()  # aborts the engine request if it still runs
            metrics.streamed.inc()
    return EventSourceResponse(events(), ping=15)


def _sse(event: dict) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event)}


def _base(body: ResponsesRequest) -> dict:
    """The response object before any output: the request's settings echoed, as OpenAI does."""
    return dict(id=new_id("resp"), object="response", created_at=now(), status="in_progress", model=body.model,
                output=[], error=None, incomplete_details=None, instructions=body.instructions,
                max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id,
                parallel_tool_calls=body.parallel_tool_calls is not False,
                reasoning={"effort": (body.reasoning or {}).get("effort"), "summary": None},
                store=body.store, temperature=body.temperature, top_p=body.top_p,
                text=body.text or {"format": {"type": "text"}}, tool_choice=body.tool_choice or "auto",
                tools=body.tools or [], truncation="disabled", metadata=body.metadata or {}, usage=None)


@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, request: Request):
    return store_of(request).get(rid)[0]


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, request: Request):
    store_of(request).delete(rid)
    return {"id": rid, "object": "response", "deleted": True}
