"""What the routers of every API family share: the served sessions (`Host`, on the app's
state), the API key check, errors and their HTTP status, and awaiting a Session's work
unless the client goes away first. Each router reads the app's state from the request, so
that the routers are plain modules and several apps in one process do not mix."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import Any

from fastapi import Depends, Request

from hearthlm.core.errors import ContextLengthError, HearthError, InvalidRequestError, QueueFull, SessionClosedError
from hearthlm.session import Session


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param  # param: the request field at fault


class ClientGone(Exception):
    """The client disconnected: its request was aborted."""


def status_of(e: HearthError) -> tuple[int, str | None]:
    """The HTTP status and OpenAI error code of an SDK error."""
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
    middleware: tuple = ()  # a Host variant's own ASGI middleware and routers (serve.router's)
    routers: tuple = ()

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

    def with_adapter(self, name: str | None) -> tuple[Session, str | None]:
        """A model name as OpenAI's `model` field names it, with a LoRA adapter where it names one
        (vLLM's convention): a served model's own name; "BASE:ADAPTER"; or an adapter's name alone,
        where one served model has it. (session, adapter name or None); 404 naming it otherwise."""
        try:
            return self.get(name), None
        except APIError as e:
            if e.status != 404 or not name:
                raise
            miss = e
        base, sep, adapter = name.rpartition(":")
        if sep and base in self.names():
            s = self.get(base)
            if adapter in s.adapters:
                return s, adapter
            raise APIError(404, f"the model {base!r} has no LoRA adapter {adapter!r}; loaded: {sorted(s.adapters)}",
                           "model_not_found")
        hits = [s for s in self.sessions.values() if name in s.adapters]
        if len(hits) == 1:
            return hits[0], name
        raise miss

    # what the listings read; serve.router's Router (models loaded on demand) says more
    def names(self) -> list[str]:
        return list(self.sessions)

    def describe(self, name: str) -> Any:
        return self.sessions[name]

    def expires_at(self, name: str) -> float | None:  # None: while the server runs
        return None

    def size(self, name: str) -> int | None:  # None: the file's size
        return None


def host_of(request: Request) -> Host:
    return request.app.state.host


def key_digest(api_key: str | None) -> bytes | None:
    """What the app keeps of its API key (app.state.key_digest): a digest, None for no key."""
    return hashlib.sha256(api_key.encode()).digest() if api_key is not None else None


def check_key(request: Request) -> None:
    digest = request.app.state.key_digest
    if digest is None:
        return
    got = request.headers.get("authorization", "")
    token = got[7:] if got.lower().startswith("bearer ") else request.headers.get("x-api-key", "")  # Anthropic's
    # constant time, and over digests so that not even the key's length shows
    if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer ..., or x-api-key)", "invalid_api_key")


AUTH = [Depends(check_key)]  # the dependencies of every route that touches a model


async def until_disconnect(request: Request, coro):
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


def replaying(body: bytes, receive):
    """An ASGI receive that gives `body`, already read whole, once, then defers to `receive`."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def request_images(messages: Any) -> None:
    """Image parts of a request's messages may be data: URLs or http(s) URLs only (fetched where
    the server allows remote media): a request never names a file of the server's to read."""
    from hearthlm.model_zoo.chat_template import IMAGE_PARTS
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        for k, p in enumerate(parts if isinstance(parts, list) else ()):
            if not (isinstance(p, dict) and p.get("type") in IMAGE_PARTS):
                continue
            src = p.get("image") if p.get("type") == "image" else p.get("image_url")
            src = src.get("url") if isinstance(src, dict) else src
            if not (isinstance(src, str) and src.split(":", 1)[0].lower() in ("data", "http", "https")):
                raise APIError(400, f"messages[{i}]['content'][{k}]: an image must be a data: URL or an http(s) "
                                    "URL (a server reads no local paths)")


class ReshapeErrors:
    """ASGI middleware: an error answer under `prefix` (the app's handlers write OpenAI's
    {"error": {"message", ...}}) leaves as `reshape(status, error)` makes it (an API family's shape)."""
    prefix = "/"

    def __init__(self, app) -> None:
        self.app = app

    @staticmethod
    def reshape(status: int, error: dict) -> dict:
        raise NotImplementedError

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        start, parts = None, []

        async def rewrite(msg) -> None:
            nonlocal start
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg
                return
            if start is None:
                return await send(msg)
            parts.append(msg.get("body", b""))
            if msg.get("more_body"):
                return
            body = b"".join(parts)
            try:
                body = json.dumps(self.reshape(start["status"], json.loads(body)["error"])).encode()
            except (ValueError, KeyError, TypeError):
                pass  # not the app's error shape (a 499 has no body): as it is
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        await self.app(scope, receive, rewrite)
