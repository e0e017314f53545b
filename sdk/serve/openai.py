"""The OpenAI API family: /v1/models, /v1/chat/completions, /v1/completions (streamed as
server-sent events) and /v1/embeddings, over the served Sessions. Included by the app
behind the API key check."""
from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from hearthlm.core.errors import HearthError
from hearthlm.serve.common import host_of, request_images, status_of, until_disconnect
from hearthlm.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    echo_logprobs,
    error_json,
    join_logprobs,
    legacy_logprobs,
    logprob_entries,
    new_id,
    now,
    usage,
)

router = APIRouter()


def _model_card(name: str) -> dict[str, Any]:
    return dict(id=name, object="model", created=0, owned_by="hearthlm")


def _adapter_cards(host) -> list[dict[str, Any]]:
    """The loaded models' LoRA adapters, as vLLM lists them: the name, with the model as parent."""
    return [dict(_model_card(a), parent=n) for n, s in list(host.sessions.items()) for a in s.adapters]


@router.get("/v1/models")
async def list_models(request: Request):
    host = host_of(request)
    return {"object": "list", "data": [_model_card(n) for n in host.names()] + _adapter_cards(host)}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request):
    host = host_of(request)
    if name not in host.names():
        s, adapter = host.with_adapter(name)  # the 404
        if adapter is not None:
            return next((c for c in _adapter_cards(host) if c["id"] == name), _model_card(name))
    return _model_card(name)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    s, adapter = host_of(request).with_adapter(body.model)
    request_images(body.messages)
    tok = s.model.tokenizer
    kw = body.session_kwargs(tok) | body.adapter_kwargs(list(s.adapters), adapter)
    k = body.top_logprobs or 0
    if body.stream:
        def piece(c, first):
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if c.reasoning:  # the thinking, apart (llama-server's and vLLM's reasoning_content)
                delta["reasoning_content"] = c.reasoning
            if c.text or not c.reasoning:
                delta["content"] = c.text
            if getattr(c, "tool_calls", None):  # from the structured-output layer, on the last chunk
                delta["tool_calls"] = [dict(index=i, **tc) for i, tc in enumerate(c.tool_calls)]
            lp = {"content": logprob_entries(tok, c.token_ids, c.top_logprobs, k)} if body.logprobs else None
            return dict(index=c.index, delta=delta, logprobs=lp, finish_reason=c.finish_reason)
        return await _sse(request, s.stream(messages=body.messages, **kw), "chat.completion.chunk", body, piece)
    cs = await until_disconnect(request, s.generate_n(messages=body.messages, **{"n": 1, **kw}))

    def choice(i, c):
        msg: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            msg["reasoning_content"] = c.reasoning
        if c.tool_calls:
            msg["tool_calls"] = c.tool_calls
        lp = {"content": logprob_entries(tok, c.token_ids, c.top_logprobs, k)} if body.logprobs else None
        return dict(index=i, message=msg, logprobs=lp, finish_reason=c.finish_reason)
    return dict(id=new_id("chatcmpl"), object="chat.completion", created=now(), model=body.model,
                choices=[choice(i, c) for i, c in enumerate(cs)],
                usage=usage(cs[0].prompt_tokens, sum(len(c.token_ids) for c in cs)), system_fingerprint=None)


@router.post("/v1/completions")
async def complete(body: CompletionRequest, request: Request):
    s, adapter = host_of(request).with_adapter(body.model)
    tok = s.model.tokenizer
    prompt, kw = body.prompt_arg(), body.session_kwargs(tok) | body.adapter_kwargs(list(s.adapters), adapter)
    echo_text = (prompt if isinstance(prompt, str) else s.detokenize(prompt)) if body.echo else ""

    def logprobs(c, first):
        if body.logprobs is None:
            return None
        lp = legacy_logprobs(tok, c.token_ids, c.top_logprobs, body.logprobs)
        if body.echo and first and c.prompt_logprobs:
            lp = join_logprobs(echo_logprobs(tok, c.prompt_logprobs, body.logprobs), lp)
        return lp

    def reason(c):
        return "length" if body.max_tokens == 0 and c.finish_reason else c.finish_reason
    if body.stream:
        def piece(c, first):
            return dict(index=c.index, text=(echo_text if first else "") + c.text, logprobs=logprobs(c, first),
                        finish_reason=reason(c))
        return await _sse(request, s.stream(prompt, **kw), "text_completion", body, piece)
    cs = await until_disconnect(request, s.generate_n(prompt, **{"n": 1, **kw}))
    return dict(id=new_id("cmpl"), object="text_completion", created=now(), model=body.model,
                choices=[dict(index=i, text=echo_text + c.text, logprobs=logprobs(c, i == 0),
                              finish_reason=reason(c)) for i, c in enumerate(cs)],
                usage=usage(cs[0].prompt_tokens, sum(len(c.token_ids) for c in cs)))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    s = host_of(request).get(body.model)
    texts = body.texts()
    vecs = await until_disconnect(request, s.embed(texts))
    n_tokens = sum(len(t) if isinstance(t, list) else len(s.tokenize(t, add_special=True)) for t in texts)
    data = [dict(object="embedding", index=i,
                 embedding=(base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                            else v.astype(np.float32).tolist()))
            for i, v in enumerate(vecs)]
    return dict(object="list", data=data, model=body.model, usage=dict(prompt_tokens=n_tokens, total_tokens=n_tokens))


async def _sse(request: Request, stream, kind: str, body, piece) -> EventSourceResponse:
    """Server-sent events: the first chunk is awaited before the response starts, so that a
    request refused at submission (full queue, bad arguments) gets its own status code."""
    first = await until_disconnect(request, anext(stream))
    rid, created = new_id("chatcmpl" if kind.startswith("chat") else "cmpl"), now()
    want_usage = bool(body.stream_options and body.stream_options.include_usage)
    metrics = request.app.state.metrics

    def event(choices, **extra) -> dict[str, str]:
        obj = dict(id=rid, object=kind, created=created, model=body.model, choices=choices, **extra)
        if want_usage and "usage" not in obj:
            obj["usage"] = None
        return {"data": json.dumps(obj)}

    async def events():
        c, n_out, seen, finished = first, 0, set(), 0
        try:
            while True:  # chunks of the n choices interleave; each one's first carries the role
                n_out += len(c.token_ids)
                yield event([piece(c, c.index not in seen)])
                seen.add(c.index)
                finished += bool(c.finish_reason)
                if finished == body.n:
                    break
                c = await anext(stream)
            if want_usage:
                yield event([], usage=usage(c.prompt_tokens or 0, n_out))
            yield {"data": "[DONE]"}
        except HearthError as e:  # mid-stream: the status is sent already; the error goes as an event
            yield {"data": json.dumps(error_json(status_of(e)[0], str(e)))}
        finally:
            await stream.aclose()  # aborts the engine request if it still runs
            metrics.streamed.inc()
    return EventSourceResponse(events(), ping=15)
