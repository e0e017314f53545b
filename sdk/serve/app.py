"""The OpenAI-compatible ASGI app: a thin layer over one Session per model (no second
engine). `build_app` opens the sessions in the app's lifespan (the CLI and Ray use it);
`create_app` serves sessions an application has already opened."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator, Mapping

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hearthlm.core.errors import (ContextLengthError, HearthError, InvalidRequestError, QueueFull,
                                     SessionClosedError)
from hearthlm.serve.metrics import Metrics
from hearthlm.serve.page import add_chat_page
from hearthlm.serve.protocol import (ChatRequest, CompletionRequest, EmbeddingRequest, RerankRequest, echo_logprobs,
                                     error_json, join_logprobs, legacy_logprobs, logprob_entries, new_id, now, usage)
from hearthlm.session import Session

MAX_BODY_BYTES = 16 * 2**20  # a request body over this is refused with 413 before it is parsed


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class ClientGone(Exception):
    """The client disconnected: its request was aborted."""


def _status(e: HearthError) -> tuple[int, str | None]:
    if isinstance(e, QueueFull):
        return 429, "queue_full"
    if isinstance(e, SessionClosedError):
        return 503, "unavailable"
    if isinstance(e, ContextLengthError):
        return 400, "context_length_exceeded"
    if isinstance(e, InvalidRequestError):
        return 400, None
    return 500, None


class Host:
    """The served sessions by model name, and whether the app is shutting down."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.closing = False

    def get(self, name: str | None) -> Session:
        if self.closing:
            raise APIError(503, "the server is shutting down")
        if not name and len(self.sessions) == 1:  # TEI-style clients name no model
            return next(iter(self.sessions.values()))
        s = self.sessions.get(name)
        if s is None:
            raise APIError(404, f"the model {name!r} does not exist; served: {sorted(self.sessions)}", "model_not_found")
        return s


def build_app(model: str | Mapping[str, str], *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              **session_options: Any) -> FastAPI:
    """An app that opens `model` (a name, path or Hub repo; or {served name: model}) with
    Session.open(**session_options) when it starts and closes it when it stops."""
    models = {model: model} if isinstance(model, str) else dict(model)
    host = Host()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for name, m in models.items():
                host.sessions[name] = await stack.enter_async_context(Session.open(m, **session_options))
            try:
                yield
            finally:
                host.closing = True  # requests still arriving get 503 while the engines stop
    return _make(host, lifespan, api_key, max_body_bytes)


def create_app(sessions: Mapping[str, Session], *, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An app serving sessions opened (and closed) by the caller."""
    host = Host()
    host.sessions.update(sessions)
    return _make(host, None, api_key, max_body_bytes)


def _make(host: Host, lifespan, api_key: str | None, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="hearthlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.host = host
    metrics = Metrics(host)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    key_digest = hashlib.sha256(api_key.encode()).digest() if api_key is not None else b""

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:] if got.lower().startswith("bearer ") else ""
        # constant time, and over digests so that not even the key's length shows
        if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), key_digest):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_api_key")

    def err(status: int, message: str, code: str | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(error_json(status, message, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return err(e.status, str(e), e.code)

    @app.exception_handler(HearthError)
    async def _hearth_error(_, e: HearthError):
        status, code = _status(e)
        return err(status, str(e), code)

    @app.exception_handler(ClientGone)
    async def _gone(_, e: ClientGone):  # nobody reads it: nginx's 499
        metrics.disconnects.inc()
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        msg = "; ".join(f"{'.'.join(str(x) for x in d['loc'][1:])}: {d['msg']}" for d in e.errors())
        return err(400, msg or "invalid request body")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return err(e.status_code, str(e.detail))

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health():
        bad = {n: s.health() for n, s in host.sessions.items() if not s.health()["ok"]}
        if host.closing or bad or not host.sessions:
            return JSONResponse({"status": "unavailable", "models": bad}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return {"object": "list", "data": [_model_card(n) for n in host.sessions]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def get_model(name: str):
        host.get(name)
        return _model_card(name)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatRequest, request: Request):
        s = host.get(body.model)
        tok = s.model.tokenizer
        kw = body.session_kwargs(tok)
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
            return await _sse(request, s.stream(messages=body.messages, **kw), "chat.completion.chunk",
                              body, piece, metrics)
        cs = await _until_disconnect(request, s.generate_n(messages=body.messages, **{"n": 1, **kw}))

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

    @app.post("/v1/completions", dependencies=auth)
    async def complete(body: CompletionRequest, request: Request):
        s = host.get(body.model)
        tok = s.model.tokenizer
        prompt, kw = body.prompt_arg(), body.session_kwargs(tok)
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
            return await _sse(request, s.stream(prompt, **kw), "text_completion", body, piece, metrics)
        cs = await _until_disconnect(request, s.generate_n(prompt, **{"n": 1, **kw}))
        return dict(id=new_id("cmpl"), object="text_completion", created=now(), model=body.model,
                    choices=[dict(index=i, text=echo_text + c.text, logprobs=logprobs(c, i == 0),
                                  finish_reason=reason(c)) for i, c in enumerate(cs)],
                    usage=usage(cs[0].prompt_tokens, sum(len(c.token_ids) for c in cs)))

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(body: EmbeddingRequest, request: Request):
        s = host.get(body.model)
        texts = body.texts()
        vecs = await _until_disconnect(request, s.embed(texts))
        n_tokens = sum(len(t) if isinstance(t, list) else len(s.tokenize(t, add_special=True)) for t in texts)
        data = [dict(object="embedding", index=i,
                     embedding=(base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                                else v.astype(np.float32).tolist()))
                for i, v in enumerate(vecs)]
        return dict(object="list", data=data, model=body.model,
                    usage=dict(prompt_tokens=n_tokens, total_tokens=n_tokens))

    async def rerank(body: RerankRequest, request: Request):
        """Scores sorted best first, top_n of them (llama-server's format_response_rerank)."""
        s = host.get(body.model or None)
        docs = body.docs()
        scores = await _until_disconnect(request, s.rerank(body.query, docs))
        tei = body.documents is None
        key = "score" if tei else "relevance_score"
        results = [{"index": i, key: sc} for i, sc in enumerate(scores)]
        results.sort(key=lambda r: -r[key])
        results = results[:body.top_n or len(results)]
        for r in results:
            if tei and body.return_text:
                r["text"] = docs[r["index"]]
            elif not tei and body.return_documents:
                r["document"] = {"text": docs[r["index"]]}
        if tei:
            return results
        n_tokens = sum(len(s.rerank_ids(body.query, d)) for d in docs)
        return dict(model=body.model, object="list", results=results,
                    usage=dict(prompt_tokens=n_tokens, total_tokens=n_tokens))

    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        app.post(path, dependencies=auth)(rerank)
    add_chat_page(app)
    from hearthlm.serve.ollama import add_ollama_routes  # here: it imports this module's helpers
    add_ollama_routes(app, host, auth)

    return app


def _model_card(name: str) -> dict[str, Any]:
    return dict(id=name, object="model", created=0, owned_by="hearthlm")


async def _until_disconnect(request: Request, coro):
    """Await `coro` unless the client goes away first: then it is cancelled (the Session
    aborts its request and frees its KV blocks)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(request: Request, stream, kind: str, body, piece, metrics) -> EventSourceResponse:
    """Server-sent events: the first chunk is awaited before the response starts, so that a
    request refused at submission (full queue, bad arguments) gets its own status code."""
    first = await _until_disconnect(request, anext(stream))
    rid, created = new_id("chatcmpl" if kind.startswith("chat") else "cmpl"), now()
    want_usage = bool(body.stream_options and body.stream_options.include_usage)

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
            yield {"data": json.dumps(error_json(_status(e)[0], str(e)))}
        finally:
            await stream.aclose()  # aborts the engine request if it still runs
            metrics.streamed.inc()
    return EventSourceResponse(events(), ping=15)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes (declared or counted) gets 413."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.limit
        parts, n, more = [], 0, True
        while more:  # read it all (dropping it once too big) so the client sees the answer
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk, more = msg.get("body", b""), msg.get("more_body", False)
            n += len(chunk)
            too_big = too_big or n > self.limit
            if not too_big:
                parts.append(chunk)
        if too_big:
            resp = JSONResponse(error_json(413, f"the request body is over {self.limit} bytes"), status_code=413)
            return await resp(scope, receive, send)
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)
