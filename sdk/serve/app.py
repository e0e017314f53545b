"""The ASGI app: one router per API family (serve.openai, serve.rerank, serve.ollama; the
chat page, serve.page) over one Session per model (no second engine), plus /health and
/metrics. `build_app` opens the sessions in the app's lifespan (the CLI and Ray use it);
`create_app` serves sessions an application has already opened. What the routers share
(the sessions, the API key check, errors) is in serve.common."""
from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hearthlm.core.errors import HearthError
from hearthlm.options import SessionOptions, takes_options
from hearthlm.serve import messages, ollama, openai, rerank, responses
from hearthlm.serve.common import AUTH, APIError, ClientGone, Host, host_of, key_digest, replaying, status_of
from hearthlm.serve.metrics import Metrics
from hearthlm.serve.page import add_chat_page
from hearthlm.serve.protocol import error_json
from hearthlm.session import Session

MAX_BODY_BYTES = 16 * 2**20  # a request body over this is refused with 413 before it is parsed


@takes_options
def build_app(model: str | Mapping[str, str], *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              options: SessionOptions | None = None, **session_options: Any) -> FastAPI:
    """An app that opens `model` (a name, path or Hub repo; or {served name: model}) with
    Session.open(options=options, **session_options) when it starts and closes it when it
    stops. The options are checked here, before the app starts."""
    models = {model: model} if isinstance(model, str) else dict(model)
    opts = SessionOptions.of(options, session_options)
    host = Host()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for name, m in models.items():
                host.sessions[name] = await stack.enter_async_context(Session.open(m, options=opts))
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
    app.state.host, app.state.metrics, app.state.key_digest = host, Metrics(host), key_digest(api_key)
    for middleware in host.middleware:  # added first, so inside BodyLimit: bodies come bounded
        app.add_middleware(middleware)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(ollama.OllamaErrors)  # outside BodyLimit: a 413 under /api/ leaves in Ollama's shape too
    app.add_middleware(messages.AnthropicErrors)  # and one under /v1/messages in Anthropic's
    for kind, handler in ((APIError, _api_error), (HearthError, _hearth_error), (ClientGone, _gone),
                          (RequestValidationError, _invalid), (StarletteHTTPException, _http)):
        app.add_exception_handler(kind, handler)
    app.include_router(_ops)
    app.include_router(openai.router, dependencies=AUTH)
    app.include_router(rerank.router, dependencies=AUTH)
    app.include_router(messages.router, dependencies=AUTH)
    app.include_router(responses.router, dependencies=AUTH)
    for extra in host.routers:  # serve.router's /models/load and /models/unload
        app.include_router(extra)
    add_chat_page(app)
    app.include_router(ollama.router)  # its routes name their dependencies (/api/version needs no key)
    return app


# ---- errors: OpenAI's shape, counted by status ------------------------------------------

def _err(request: Request, status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    request.app.state.metrics.errors.labels(str(status)).inc()
    return JSONResponse(error_json(status, message, code, param), status_code=status)


async def _api_error(request: Request, e: APIError):
    return _err(request, e.status, str(e), e.code, e.param)


async def _hearth_error(request: Request, e: HearthError):
    status, code = status_of(e)
    return _err(request, status, str(e), code)


async def _gone(request: Request, e: ClientGone):  # nobody reads it: nginx's 499
    request.app.state.metrics.disconnects.inc()
    return Response(status_code=499)


async def _invalid(request: Request, e: RequestValidationError):
    msg = "; ".join(f"{'.'.join(str(x) for x in d['loc'][1:])}: {d['msg']}" for d in e.errors())
    return _err(request, 400, msg or "invalid request body")


async def _http(request: Request, e: StarletteHTTPException):
    return _err(request, e.status_code, str(e.detail))


# ---- the server's own state: no API key (they say nothing about the models) ---------------

_ops = APIRouter()


@_ops.get("/health")
async def health(request: Request):
    host = host_of(request)
    bad = {n: s.health() for n, s in host.sessions.items() if not s.health()["ok"]}
    if host.closing or bad or not host.names():
        return JSONResponse({"status": "unavailable", "models": bad}, status_code=503)
    return {"status": "ok"}


@_ops.get("/metrics")
async def prometheus(request: Request):
    body, ctype = request.app.state.metrics.render()
    return Response(body, media_type=ctype)


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
        await self.app(scope, replaying(b"".join(parts), receive), send)
