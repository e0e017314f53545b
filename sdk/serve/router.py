"""Models that come and go (`hearthlm serve --models-dir DIR`): every GGUF in a folder is
served by its file's stem and opened when a request names it (llama-server's router mode,
Ollama's scheduler). `Router` is the Host the API routers read; `Leases` (ASGI middleware)
loads a request's model before the route runs and holds it until the response's last byte
is sent, so that an eviction (--max-loaded, least recently used first), an idle unload
(--idle-unload, Ollama's keep_alive) or POST /models/unload waits for streams in flight."""
from __future__ import annotations

import asyncio
import gc
import json
import math
import re
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from hearthlm.core.errors import HearthError
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.model_zoo.resolve import is_mmproj
from hearthlm.options import SessionOptions
from hearthlm.serve.app import MAX_BODY_BYTES, _make
from hearthlm.serve.common import AUTH, APIError, Host, check_key, host_of, replaying, status_of
from hearthlm.serve.protocol import error_json
from hearthlm.session import Session

MIB = 2**20
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})$")  # llama.cpp's split parts: name-00001-of-00003.gguf


def free_bytes() -> int:
    """Memory the kernel can give without swapping (MemAvailable), psutil's reading where present."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # no reading on this platform: nothing is refused


def scan(folder: Path) -> dict[str, Path]:
    """{stem: file} of the models in `folder`: mmproj files left out, a split model by its first part."""
    found: dict[str, Path] = {}
    for p in sorted(folder.glob("*.gguf")):
        stem = p.name[:-5]
        if not p.is_file() or is_mmproj(p.name):
            continue
        if m := _SPLIT.match(stem):
            if int(m.group(2)) != 1:
                continue
            stem = m.group(1)
        found[stem] = p
    return found


def need_bytes(path: Path, o: SessionOptions) -> int:
    """What opening `path` takes: its tensors' bytes plus the KV cache for the context it gets."""
    with GGUFFile.open(path) as f:
        weights = sum(t.nbytes for t in f.tensors.values())
        arch, md = f.architecture, f.metadata

        def num(key: str, default: Any = 0) -> int:
            v = md.get(f"{arch}.{key}", default)
            return int(max(v) if isinstance(v, (list, tuple)) else v)
        n_layer, n_head = num("block_count"), max(num("attention.head_count", 1), 1)
        head_dim = num("embedding_length") // n_head
        kv_row = num("attention.head_count_kv", n_head) * (num("attention.key_length", head_dim)
                                                           + num("attention.value_length", head_dim))
        n_ctx = min(o.n_ctx, num("context_length", o.n_ctx) or o.n_ctx)
    per = 4 if o.kv_cache_type == "f32" else 2  # f16 and wider estimates for quantized KV: an upper bound
    return weights + n_layer * (o.kv_cache_tokens or 4 * n_ctx) * kv_row * per


def seconds(v: Any) -> float | None:
    """Ollama's keep_alive: seconds (a number or its string) or a Go duration ("5m", "1h30m");
    negative means for ever (inf); None when absent."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise APIError(400, f"keep_alive: {v!r} is not a duration")
    if isinstance(v, (int, float)):
        out = float(v)
    elif isinstance(v, str) and re.fullmatch(r"-?\d+(\.\d+)?", v.strip()):
        out = float(v)
    elif isinstance(v, str) and (parts := re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", v.strip().lstrip("-"))) \
            and "".join(a + u for a, u in parts) == v.strip().lstrip("-"):
        unit = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
        out = math.copysign(sum(float(a) * unit[u] for a, u in parts), -1 if v.strip().startswith("-") else 1)
    else:
        raise APIError(400, f'keep_alive: {v!r} is not a duration (seconds, or such as "5m", "1h"; -1 keeps it)')
    return math.inf if out < 0 else out


@dataclass
class _Slot:
    path: Path
    session: Session | None = None
    closer: Any = None          # Session.open's context manager: exiting it closes the session
    users: int = 0              # requests holding it (a stream counts until its last byte)
    last: float = 0.0           # time.monotonic() when its last request ended
    keep: float | None = None   # seconds idle before it goes (keep_alive); None: the router's default
    size: int = 0               # need_bytes when it was loaded
    leaving: bool = False       # being unloaded: new requests wait for that, then load it again
    view: Any = field(default=None, repr=False)  # _FileView for the listings, opened once


class _FileView:
    """What the Ollama listings read of a Session (s.model.file, .metadata, .arch_name), from the
    file's header alone, for a model not loaded."""

    def __init__(self, path: Path) -> None:
        self.file = GGUFFile.open(path)
        self.metadata, self.arch_name, self.model = self.file.metadata, self.file.architecture, self


class Router(Host):
    """The models of a folder, opened on demand; `sessions` holds those loaded now."""

    def __init__(self, folder: str | Path, *, options: SessionOptions, max_loaded: int | None = None,
                 idle_unload: float | None = None) -> None:
        super().__init__()
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise HearthError(f"--models-dir {folder}: not a directory")
        self.slots = {n: _Slot(p) for n, p in scan(self.folder).items()}
        if not self.slots:
            raise HearthError(f"--models-dir {folder}: no .gguf model files in it")
        if max_loaded is not None and max_loaded < 1:
            raise HearthError(f"--max-loaded must be 1 or more, got {max_loaded}")
        self.options, self.max_loaded, self.idle_unload = options, max_loaded, idle_unload
        self.middleware, self.routers = (Leases,), (routes,)  # what the app adds for it
        self._lock = asyncio.Lock()  # one load or unload at a time; waiters for the same model share its load

    # ---- what the API routers read ----------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.slots)

    def resolve(self, name: str) -> str:
        if name not in self.slots and name.endswith(":latest") and name[:-7] in self.slots:
            name = name[:-7]
        if name not in self.slots:
            raise APIError(404, f"the model {name!r} does not exist; served: {self.names()}", "model_not_found")
        return name

    def describe(self, name: str) -> Any:
        slot = self.slots[name]
        if slot.session is not None:
            return slot.session
        if slot.view is None:
            slot.view = _FileView(slot.path)
        return slot.view

    def expires_at(self, name: str) -> float | None:
        slot = self.slots[name]
        keep = self._keep(slot)
        if slot.users or keep is None or math.isinf(keep):
            return None
        return time.time() + keep - (time.monotonic() - slot.last)

    def size(self, name: str) -> int | None:
        return self.slots[name].size

    # ---- loading and leaving ----------------------------------------------------------------
    async def acquire(self, name: str, keep: float | None = None) -> str:
        """Hold model `name` (loading it first, evicting if need be) for one request; release() ends it."""
        if self.closing:
            raise APIError(503, "the server is shutting down")
        name = self.resolve(name)
        slot = self.slots[name]
        if slot.session is None or slot.leaving:
            async with self._lock:
                if slot.session is None:
                    await self._load(name)
                slot.users += 1
        else:
            slot.users += 1
        slot.keep = keep
        return name

    def release(self, name: str) -> None:
        slot = self.slots[name]
        slot.users -= 1
        slot.last = time.monotonic()  # the reaper unloads it once idle its keep time (0: at once)

    async def unload(self, name: str, *, only_idle: bool = False) -> bool:
        """Unload `name` once its requests finish (only_idle: only if it is still idle then)."""
        async with self._lock:
            slot = self.slots[name]
            if slot.session is None or only_idle and (slot.users or not self._expired(slot)):
                return False
            await self._unload(name)
            return True

    async def load(self, name: str) -> None:
        await self.acquire(name, self.slots[self.resolve(name)].keep)
        self.release(self.resolve(name))

    async def _load(self, name: str) -> None:
        slot = self.slots[name]
        need = need_bytes(slot.path, self.options)
        while self.max_loaded and len(self.sessions) >= self.max_loaded:
            await self._unload(self._lru())
        free = free_bytes()
        while need > free and self.sessions:  # the least recently used make room, if that is enough
            await self._unload(self._lru())
            free = free_bytes()
        if need > free:
            raise APIError(503, f"the model {name!r} needs about {need / MIB:.0f} MiB (weights and KV cache) "
                                f"but {free / MIB:.0f} MiB is free", "insufficient_memory")
        opts = self.options
        if len(self.slots) > 1 and opts.mmproj is None:  # a lone mmproj*.gguf is not every model's
            from hearthlm.model_zoo.vision.clip import find_mmproj
            mine = find_mmproj(slot.path)
            opts = SessionOptions.of(opts, dict(mmproj=mine if mine and _pairs(mine, slot.path) else False))
        closer = Session.open(str(slot.path), options=opts)
        slot.session = await closer.__aenter__()
        slot.closer, slot.size, slot.last = closer, need, time.monotonic()
        self.sessions[name] = slot.session

    async def _unload(self, name: str) -> None:
        slot = self.slots[name]
        slot.leaving = True
        try:
            while slot.users:  # a stream in flight is never cut
                await asyncio.sleep(0.02)
            gone = weakref.ref(slot.session)
            closer, slot.session, slot.closer = slot.closer, None, None
            self.sessions.pop(name, None)
            await closer.__aexit__(None, None, None)
            del closer
            if gone() is not None:  # held by a cycle (a caught exception's frames): freed now, not at some later gc
                gc.collect()
        finally:
            slot.leaving = False

    def _lru(self) -> str:
        return min(self.sessions, key=lambda n: (self.slots[n].users > 0, self.slots[n].last))

    def _keep(self, slot: _Slot) -> float | None:
        return self.idle_unload if slot.keep is None else slot.keep

    def _expired(self, slot: _Slot) -> bool:
        keep = self._keep(slot)
        return keep is not None and time.monotonic() - slot.last >= keep

    async def reap(self) -> None:
        """Unload the models idle longer than their keep time; runs while the app does."""
        while True:
            await asyncio.sleep(0.1)
            for name, slot in list(self.slots.items()):
                if slot.session is not None and not slot.users and not slot.leaving and self._expired(slot):
                    await self.unload(name, only_idle=True)

    async def close_all(self) -> None:
        for name in list(self.sessions):
            async with self._lock:
                if self.slots[name].session is not None:
                    await self._unload(name)


def _pairs(mmproj: Path, model: Path) -> bool:
    stem = model.name[:-5]
    return mmproj.name in (f"{stem}.mmproj.gguf", f"mmproj-{stem}.gguf")


# ---- the middleware: a request's model loaded before its route, held to its last byte -------

class Leases:
    """ASGI middleware: a POST whose JSON body names a `model` (or Ollama's `name`) holds that model
    from before its route runs until its response (streamed or not) is sent."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].startswith("/models/"):
            return await self.app(scope, receive, send)
        parts, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(parts)
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None  # the route says what is wrong with it
        name = (data.get("model") or data.get("name")) if isinstance(data, dict) else None
        host: Router = scope["app"].state.host
        replay = replaying(body, receive)
        if not isinstance(name, str) or not name:
            return await self.app(scope, replay, send)
        try:
            check_key(Request(scope))  # nobody without the key makes a model load
            name = await host.acquire(name, seconds(data.get("keep_alive")))
        except (APIError, HearthError) as e:
            status, code = (e.status, e.code) if isinstance(e, APIError) else status_of(e)
            scope["app"].state.metrics.errors.labels(str(status)).inc()
            return await JSONResponse(error_json(status, str(e), code), status_code=status)(scope, replay, send)
        try:
            await self.app(scope, replay, send)
        finally:
            host.release(name)


# ---- llama-server's router routes -------------------------------------------------------------

routes = APIRouter(dependencies=AUTH)


class ModelBody(BaseModel):
    model: str


@routes.post("/models/load")
async def load(body: ModelBody, request: Request):
    await _router(request).load(body.model)
    return {"success": True}


@routes.post("/models/unload")
async def unload(body: ModelBody, request: Request):
    router = _router(request)
    name = router.resolve(body.model)
    if router.slots[name].session is None:
        raise APIError(400, f"the model {name!r} is not loaded")
    await router.unload(name)
    return {"success": True}


@routes.get("/models")
async def models(request: Request):
    router = _router(request)
    return {"data": [dict(id=n, object="model", owned_by="hearthlm", path=str(s.path),
                          status={"value": "loaded" if s.session is not None else "unloaded"})
                     for n, s in sorted(router.slots.items())]}


def _router(request: Request) -> Router:
    return host_of(request)  # these routes are the Router's own: no other Host has them


def build_router_app(folder: str | Path, *, max_loaded: int | None = None, idle_unload: float | None = None,
                     options: SessionOptions | None = None, api_key: str | None = None,
                     max_body_bytes: int | None = None) -> FastAPI:
    """An app serving the models of `folder`, each opened with `options` when a request names it."""
    router = Router(folder, options=options or SessionOptions(), max_loaded=max_loaded, idle_unload=idle_unload)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.get_running_loop().create_task(router.reap())
        try:
            yield
        finally:
            router.closing = True
            reaper.cancel()
            await router.close_all()
    return _make(router, lifespan, api_key, max_body_bytes or MAX_BODY_BYTES)
