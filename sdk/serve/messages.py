"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as a translation
over the OpenAI route's pieces: Anthropic's blocks become the OpenAI-shaped messages and tools
Session takes, sampling goes through ChatRequest (checked once), and the Completion or Chunks
come back as content blocks (thinking, text, tool_use) or Anthropic's SSE events. Errors leave in
Anthropic's shape, {"type": "error", "error": {"type", "message"}} (AnthropicErrors)."""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from hearthlm.core.errors import HearthError
from hearthlm.model_zoo import reasoning
from hearthlm.serve.common import APIError, ReshapeErrors, host_of, request_images, status_of, until_disconnect
from hearthlm.serve.protocol import ChatRequest, _Body, new_id
from hearthlm.session import Session

router = APIRouter()
# status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


class CountBody(_Body):
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesBody(CountBody):
    max_tokens: int  # required, as Anthropic has it
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # beyond Anthropic's, as the OpenAI route takes it
    stream: bool = False


@router.post("/v1/messages")
async def messages(body: MessagesBody, request: Request):
    s = _session(request, body.model)
    args = _args(s, body)
    samp = ChatRequest(model=body.model, messages=[], max_tokens=body.max_tokens, temperature=body.temperature,
                       top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop_sequences or None)
    kw = {**samp.session_kwargs(s.model.tokenizer), **args}
    if body.stream:
        n_in = await s.count_tokens(**_counted(kw))
        return await _sse(request, s.stream(**kw), body.model, n_in)
    c = await until_disconnect(request, s.generate(**kw))
    blocks = ([_thinking_block(c.reasoning)] if c.reasoning else []) + \
        ([dict(type="text", text=c.text)] if c.text else []) + [_tool_use(t) for t in c.tool_calls or ()]
    return _message(body.model, blocks, _stop_reason(c), c.stop_sequence,
                    dict(input_tokens=c.prompt_tokens, output_tokens=len(c.token_ids)))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountBody, request: Request):
    s = _session(request, body.model)
    return dict(input_tokens=await s.count_tokens(**_counted(_args(s, body))))


def _session(request: Request, model: str) -> Session:
    if not model:
        raise APIError(400, "model: a served model's name is required")
    return host_of(request).get(model)


def _counted(kw: dict) -> dict:
    """The Session arguments that shape the prompt (count_tokens takes these)."""
    return {k: kw[k] for k in ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_budget") if k in kw}


# ---- requests: Anthropic's shapes as OpenAI's ----------------------------------------------

def _args(s: Session, body: CountBody) -> dict[str, Any]:
    """messages, tools, tool_choice and the thinking's arguments for Session."""
    if not body.messages:
        raise APIError(400, "messages: at least one message is required")
    msgs = ([dict(role="system", content=_text(body.system, "system"))] if body.system else []) + _messages(body.messages)
    request_images(msgs)  # data: or http(s) URLs only; remote ones where the server allows them
    kw: dict[str, Any] = dict(messages=msgs, **_thinking(s, body.thinking))
    if body.tools:
        kw["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        kw["tool_choice"] = _tool_choice(body.tool_choice)
    return kw


def _text(x: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(x, str):
        return x
    if not isinstance(x, list) or not all(isinstance(b, dict) and b.get("type") == "text" for b in x):
        raise APIError(400, f"{where}: must be a string or a list of text blocks")
    return "\n".join(str(b.get("text", "")) for b in x)


def _messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages' name
    for i, m in enumerate(msgs):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages[{i}].role: must be 'user' or 'assistant' (system goes in `system`)")
        if isinstance(content, str):
            out.append(dict(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise APIError(400, f"messages[{i}].content: must be a string or a list of content blocks")
        parts, calls, thinking, results, result_images = [], [], [], [], []
        for k, b in enumerate(content):
            where, kind = f"messages[{i}].content[{k}]", b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                parts.append(dict(type="text", text=str(b.get("text", ""))))
            elif kind == "image" and role == "user":
                parts.append(_image(b, where))
            elif kind == "tool_use" and role == "assistant":
                names[b.get("id", "")] = b.get("name", "")
                calls.append(dict(id=b.get("id", ""), type="function",
                                  function=dict(name=b.get("name", ""), arguments=json.dumps(b.get("input") or {}))))
            elif kind == "tool_result" and role == "user":
                text, images = _tool_result(b, where)
                results.append(dict(role="tool", tool_call_id=b.get("tool_use_id", ""),
                                    name=names.get(b.get("tool_use_id", ""), ""), content=text))
                result_images += images
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(b.get("thinking", "")))
            elif kind != "redacted_thinking":  # nothing to read in it: dropped
                raise APIError(400, f"{where}: a {kind!r} block is not supported in a {role} message")
        out += results  # tool results come first in a user turn: they answer the calls before it
        if result_images:  # OpenAI's tool messages take text: the images follow as the user's
            out.append(dict(role="user", content=result_images))
        if parts or calls or thinking or not results:
            msg: dict[str, Any] = dict(role=role, content=_content(parts))
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def _content(parts: list[dict]) -> str | list[dict]:
    """Text alone as a string (what every template reads); with images, the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image(b: dict, where: str) -> dict:
    src = b.get("source") or {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        return dict(type="image_url", image_url=dict(url=f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"))
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return dict(type="image_url", image_url=dict(url=src["url"]))
    raise APIError(400, f"{where}.source: an image source must be {{type: base64, media_type, data}} or {{type: url, url}}")


def _tool_result(b: dict, where: str) -> tuple[str, list[dict]]:
    """A tool_result's text (string or text blocks; "Error: " before it when is_error) and its images."""
    content, images = b.get("content", ""), []
    if isinstance(content, list):
        texts = []
        for k, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text":
                texts.append(str(p.get("text", "")))
            elif kind == "image":
                images.append(_image(p, f"{where}.content[{k}]"))
            else:
                raise APIError(400, f"{where}.content[{k}]: a tool result holds text and image blocks, not {kind!r}")
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content: must be a string or a list of blocks")
    return ("Error: " + content if b.get("is_error") else content), images


def _tool(t: Any, i: int) -> dict:
    if not isinstance(t, dict) or not t.get("name"):
        raise APIError(400, f"tools[{i}]: a tool needs a name (and an input_schema)")
    if t.get("type") not in (None, "custom"):
        raise APIError(400, f"tools[{i}]: Anthropic's server tool {t['type']!r} is not supported; give custom tools "
                            "with name, description and input_schema")
    return dict(type="function", function=dict(name=t["name"], description=t.get("description", ""),
                                                parameters=t.get("input_schema") or {"type": "object"}))


def _tool_choice(tc: dict) -> str | dict:
    kind = tc.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and tc.get("name"):
        return dict(type="function", function=dict(name=tc["name"]))
    raise APIError(400, "tool_choice: must be {type: auto}, {type: any}, {type: none} or {type: tool, name}")


def _thinking(s: Session, t: dict | None) -> dict[str, Any]:
    """thinking {type: enabled, budget_tokens} (or adaptive) turns the template's thinking on, with
    that budget; disabled turns it off. A model that does not think answers without a thinking block."""
    if t is None or reasoning.detect(s.model.chat_template) is None:
        if t is not None and t.get("type") not in ("enabled", "adaptive", "disabled"):
            raise APIError(400, "thinking.type: must be 'enabled', 'adaptive' or 'disabled'")
        return {}
    kind = t.get("type")
    if kind == "disabled":
        return dict(chat_template_kwargs=dict(enable_thinking=False), reasoning_budget=0)
    if kind == "adaptive":
        return dict(chat_template_kwargs=dict(enable_thinking=True))
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise APIError(400, "thinking.budget_tokens: must be an int >= 1")
        return dict(chat_template_kwargs=dict(enable_thinking=True), reasoning_budget=budget)
    raise APIError(400, "thinking.type: must be 'enabled', 'adaptive' or 'disabled'")


# ---- answers ------------------------------------------------------------------------------

def _message(model: str, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
    return dict(id=new_id("msg"), type="message", role="assistant", model=model, content=content,
                stop_reason=stop_reason, stop_sequence=stop_sequence, usage=usage)


def _stop_reason(c) -> str:
    if c.finish_reason == "tool_calls":
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_sequence else "end_turn"


def _thinking_block(text: str) -> dict:
    # the signature is Anthropic's proof of its own thinking; a local model has none to give
    return dict(type="thinking", thinking=text, signature="")


def _tool_use(call: dict) -> dict:
    f = call["function"]
    try:
        args = json.loads(f.get("arguments") or "{}")
    except ValueError:
        args = {}
    return dict(type="tool_use", id=call.get("id") or new_id("toolu"), name=f["name"], input=args)


class _Blocks:
    """The content blocks of a stream: a block opens when the kind of the pieces changes."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def put(self, kind: str, text: str) -> list[dict]:
        out = []
        if kind != self.kind:
            out += self.close()
            self.index, self.kind = self.index + 1, kind
            block = _thinking_block("") if kind == "thinking" else dict(type="text", text="")
            out.append(_event("content_block_start", index=self.index, content_block=block))
        delta = dict(type="thinking_delta", thinking=text) if kind == "thinking" else dict(type="text_delta", text=text)
        return out + [_event("content_block_delta", index=self.index, delta=delta)]

    def tool(self, call: dict) -> list[dict]:
        out = self.close()
        self.index += 1
        block = _tool_use(call)
        args = json.dumps(block.pop("input"))
        return out + [_event("content_block_start", index=self.index, content_block=dict(block, input={})),
                      _event("content_block_delta", index=self.index, delta=dict(type="input_json_delta", partial_json=args)),
                      _event("content_block_stop", index=self.index)]

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        out = [_event("content_block_delta", index=self.index, delta=dict(type="signature_delta", signature=""))] \
            if self.kind == "thinking" else []
        self.kind = None
        return out + [_event("content_block_stop", index=self.index)]


def _event(name: str, **data) -> dict[str, str]:
    return {"event": name, "data": json.dumps(dict(type=name, **data))}


async def _sse(request: Request, stream, model: str, n_in: int) -> EventSourceResponse:
    """Anthropic's events; the first chunk is awaited before the response starts, so that a
    request refused at submission gets its own status code."""
    first = await until_disconnect(request, anext(stream))

    async def events():
        c, n_out, blocks = first, 0, _Blocks()
        try:
            yield _event("message_start", message=_message(model, [], None, None, dict(input_tokens=n_in, output_tokens=0)))
            yield _event("ping")
            while True:
                n_out += len(c.token_ids)
                for e in (blocks.put("thinking", c.reasoning) if c.reasoning else []) + \
                        (blocks.put("text", c.text) if c.text else []):
                    yield e
                if c.finish_reason:
                    break
                c = await anext(stream)
            for e in [*blocks.close(), *(e for t in c.tool_calls or () for e in blocks.tool(t))]:
                yield e
            yield _event("message_delta", delta=dict(stop_reason=_stop_reason(c), stop_sequence=c.stop_sequence),
                         usage=dict(input_tokens=c.prompt_tokens or n_in, output_tokens=n_out))
            yield _event("message_stop")
        except HearthError as e:  # mid-stream: the status is sent already; the error goes as an event
            yield _event("error", error=dict(type=ERROR_TYPES.get(status_of(e)[0], "api_error"), message=str(e)))
        finally:
            await stream.aclose()  # aborts the engine request if it still runs
            request.app.state.metrics.streamed.inc()
    return EventSourceResponse(events(), ping=15)


class AnthropicErrors(ReshapeErrors):
    """Errors under /v1/messages in Anthropic's {"type": "error", "error": {"type", "message"}}."""
    prefix = "/v1/messages"

    @staticmethod
    def reshape(status: int, error: dict) -> dict:
        return dict(type="error", error=dict(type=ERROR_TYPES.get(status, "api_error"), message=error["message"]))
