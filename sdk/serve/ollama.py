"""The Ollama API beside the OpenAI one (same port, Ollama's paths and shapes): /api/chat,
/api/generate, /api/embed and the legacy /api/embeddings, /api/tags, /api/ps, /api/show,
/api/version. The same Sessions underneath; sampling, tools, structured output and thinking
go through the OpenAI route's ChatRequest (protocol.py), so they are checked once; errors go
through the app's handlers and leave in Ollama's shape, {"error": "message"} (OllamaErrors, which
the app adds with this router, behind the same API key as /v1 but for /api/version)."""
from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections import Counter
from datetime import datetime, timezone
from importlib import metadata as pkg_metadata
from math import prod
from typing import Any

import gguf
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from hearthlm.core.errors import HearthError
from hearthlm.model_zoo import reasoning
from hearthlm.model_zoo.chat_template import MEDIA_MARKER
from hearthlm.serve.common import AUTH, APIError, ReshapeErrors, host_of, until_disconnect
from hearthlm.serve.protocol import ChatRequest, _Body, logprob_entries
from hearthlm.session import Session

NEVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: a model stays loaded while the server runs
OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}  # samplers hearthlm lacks: taken only when off
REFUSED = {  # /api/generate fields hearthlm has no way to honour
    "template": "a Go template; the model's own chat template is used (or raw=true with a formatted prompt)",
    "suffix": "fill-in-the-middle is not supported",
    "context": "it is deprecated in Ollama (and never returned here); send the conversation to /api/chat",
}


class Options(_Body):
    """Ollama's options (Modelfile parameters). Unknown ones and load-time ones (num_gpu,
    num_thread, use_mmap, ...: the server fixed them at start) are ignored, as Ollama ignores
    unknown options; samplers hearthlm lacks are refused unless off (never silently dropped)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1 or -2: until the context is full
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None  # over all the tokens: repeat_last_n is ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None  # ignored: the server's --n-ctx holds, and a longer prompt is refused
    mirostat: int = 0
    typical_p: float = 1.0
    tfs_z: float = 1.0

    def sampling(self) -> dict[str, Any]:
        """ChatRequest's sampling fields."""
        for k, off in OFF.items():
            if getattr(self, k) != off:
                raise APIError(400, f"options.{k} is not supported: hearthlm samples with temperature, top_k, "
                                    f"top_p, min_p and the penalties (leave {k} out, or {off})")
        if self.num_predict == 0:
            raise APIError(400, "options.num_predict must be >= 1, or -1 for until the context is full")
        return dict(max_tokens=self.num_predict if self.num_predict and self.num_predict > 0 else None,
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    seed=self.seed, stop=self.stop, repeat_penalty=self.repeat_penalty,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


class _GenBody(_Body):
    model: str
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema: constrained decoding
    options: Options | None = None
    stream: bool = True  # Ollama's default
    think: bool | str | None = None
    keep_alive: str | float | None = None  # ignored: models stay loaded while the server runs
    logprobs: bool = False
    top_logprobs: int | None = None


class ChatBody(_GenBody):
    messages: list[Any] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_GenBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    template: str | None = None  # these three: REFUSED
    suffix: str | None = None
    context: list[int] | None = None


class EmbedBody(_Body):
    model: str
    input: str | list[str] = ""
    truncate: bool = True  # Ollama's default: cut an input to fit the context
    dimensions: int | None = None
    keep_alive: str | float | None = None


class EmbeddingsBody(_Body):
    model: str
    prompt: str = ""


class ShowBody(_Body):
    model: str = ""
    name: str = ""  # the older clients' field
    verbose: bool = False


router = APIRouter()


def _find(request: Request, name: str) -> tuple[str, Session]:
    """A served name, or that name with Ollama's default tag ":latest"."""
    host = host_of(request)
    if name not in host.sessions and name.endswith(":latest") and name[:-7] in host.sessions:
        name = name[:-7]
    if not name and len(host.sessions) != 1:
        raise APIError(400, "model is required")
    if name and name not in host.sessions and not host.closing:
        raise APIError(404, f'model "{name}" not found; served: {", ".join(sorted(host.sessions))}',
                       "model_not_found")
    return name, host.get(name)


def _adapter(request: Request, name: str) -> str | None:
    """The LoRA adapter a generation's model name chooses ("BASE:ADAPTER", or an adapter's name), or None."""
    host = host_of(request)
    if name in host.sessions or not name or name.endswith(":latest") and name[:-7] in host.sessions:
        return None
    try:
        return host.with_adapter(name)[1]
    except APIError as e:  # not an adapter either: _find names it in Ollama's words
        if e.status != 404:
            raise
        return None


def _find_adapted(request: Request, name: str) -> tuple[Session, str | None]:
    """_find, or the session whose LoRA adapter the name chooses."""
    adapter = _adapter(request, name)
    return (host_of(request).with_adapter(name)[0] if adapter else _find(request, name)[1]), adapter


def _adapter_cards(request: Request) -> list[dict[str, Any]]:
    """The served models' LoRA adapters as /api/tags entries "BASE:ADAPTER" (the adapter's file)."""
    out = []
    for n, s in list(host_of(request).sessions.items()):
        for a, path in s.adapters.items():
            st = os.stat(path)
            out.append(dict(name=f"{n}:{a}", model=f"{n}:{a}", modified_at=_iso(st.st_mtime), size=st.st_size,
                            digest="", details=dict(_details(s), parent_model=n, format="gguf-lora")))
    return out


def _card(request: Request, name: str, s: Session) -> dict[str, Any]:
    """/api/tags' entry of a served model; its file facts read once per app."""
    state = request.app.state
    if not hasattr(state, "ollama_cards"):
        state.ollama_cards = {}
    cards = state.ollama_cards
    if name not in cards:
        ident = s.model.file.identity()
        cards[name] = dict(name=name, model=name, modified_at=_iso(ident["mtime_ns"] / 1e9), size=ident["size"],
                           digest=ident["table"], details=_details(s))
    return dict(cards[name])


@router.post("/api/chat", dependencies=AUTH)
async def chat(body: ChatBody, request: Request):
    s, adapter = _find_adapted(request, body.model)
    if not body.messages:  # Ollama's "load the model" call
        return _loaded(body.model, message=dict(role="assistant", content=""))
    msgs = _messages(body.messages)
    kw = _kwargs(s, body, msgs, tools=body.tools, adapter=adapter)
    return await _answer(request, s, body, kw, dict(messages=msgs), _chat_shape)


@router.post("/api/generate", dependencies=AUTH)
async def generate(body: GenerateBody, request: Request):
    s, adapter = _find_adapted(request, body.model)
    for field, why in REFUSED.items():
        if getattr(body, field):
            raise APIError(400, f"{field} is not supported: {why}")
    if not body.prompt:  # Ollama's "load the model" call
        return _loaded(body.model, response="")
    raw = body.raw or not s.model.chat_template  # without a template Ollama's default is the prompt itself
    if raw and body.system:
        raise APIError(400, "system needs the chat template: with raw=true, write it into the prompt")
    if raw:
        images = _images(body.images, "images") if body.images else None
        if images and MEDIA_MARKER not in body.prompt:  # Ollama's raw prompts take the images first
            body.prompt = MEDIA_MARKER * len(images) + body.prompt
        return await _answer(request, s, body, _kwargs(s, body, None, adapter=adapter),
                             dict(prompt=body.prompt, images=images),
                             _gen_shape)
    msgs = ([dict(role="system", content=body.system)] if body.system else []) + \
        [_with_images(dict(role="user", content=body.prompt), body.images, "images")]
    return await _answer(request, s, body, _kwargs(s, body, msgs, adapter=adapter), dict(messages=msgs), _gen_shape)


@router.post("/api/embed", dependencies=AUTH)
async def embed(body: EmbedBody, request: Request):
    _, s = _find(request, body.model)
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported: the model's own size is returned")
    texts = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
    t0 = time.perf_counter_ns()
    vecs = await until_disconnect(request, s.embed(texts, truncate=body.truncate)) if texts else []
    n = sum(min(len(s.tokenize(t, add_special=True)), s.n_ctx) for t in texts)
    return dict(model=body.model, embeddings=[v.astype(np.float32).tolist() for v in vecs],
                total_duration=time.perf_counter_ns() - t0, load_duration=0, prompt_eval_count=n)


@router.post("/api/embeddings", dependencies=AUTH)
async def embeddings(body: EmbeddingsBody, request: Request):
    """The legacy form: one prompt, its embedding not normalized (as Ollama's is not)."""
    _, s = _find(request, body.model)
    if not body.prompt:
        return dict(embedding=[])
    vecs = await until_disconnect(request, s.embed([body.prompt], normalize=False, truncate=True))
    return dict(embedding=vecs[0].astype(np.float32).tolist())


@router.get("/api/tags", dependencies=AUTH)
async def tags(request: Request):
    host = host_of(request)
    return dict(models=[_card(request, n, host.describe(n)) for n in host.names()] + _adapter_cards(request))


@router.get("/api/ps", dependencies=AUTH)
async def ps(request: Request):
    host = host_of(request)

    def until(n: str) -> str:
        t = host.expires_at(n)
        return NEVER if t is None else _iso(t)
    return dict(models=[dict(_card(request, n, s), expires_at=until(n), size_vram=0, context_length=s.n_ctx,
                             **({"size": host.size(n)} if host.size(n) else {}))
                        for n, s in list(host.sessions.items())])


@router.post("/api/show", dependencies=AUTH)
async def show(body: ShowBody, request: Request):
    name, s = _find(request, body.model or body.name)
    m, c = s.model, _card(request, name, s)
    info = {k: _plain(v, body.verbose) for k, v in m.metadata.items()
            if not k.startswith("tokenizer.chat_template")}  # that one is `template`
    info["general.parameter_count"] = _n_params(s)
    return dict(modelfile=f"# Modelfile generated by hearthlm\nFROM {m.path}\nPARAMETER num_ctx {s.n_ctx}\n",
                parameters=f"num_ctx {s.n_ctx}", template=m.chat_template or "", details=c["details"],
                model_info=info, capabilities=_capabilities(s), modified_at=c["modified_at"],
                license=str(m.metadata.get("general.license", "")))


@router.get("/api/version")  # no API key: like /health it says nothing about the models
async def version():
    try:
        return dict(version=pkg_metadata.version("hearthlm"))
    except pkg_metadata.PackageNotFoundError:  # run from a source tree
        return dict(version="0.0.0")


# ---- requests ---------------------------------------------------------------------------

def _messages(msgs: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as the OpenAI-shaped ones Session takes: content defaults to "" (as in
    Ollama), tool_calls with object arguments are taken as they are, `thinking` goes to the
    templates' `reasoning_content`."""
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with role and content")
        images = m.get("images")
        m = {"content": "", **{k: v for k, v in m.items() if k != "images"}}  # the client drops an empty one
        m = _with_images(m, images, f"messages[{i}]['images']")
        if m.get("thinking") is not None:
            m["reasoning_content"] = m.pop("thinking")
        if m.get("tool_name") and "name" not in m:  # the templates' name for it
            m["name"] = m["tool_name"]
        out.append(m)
    return out


def _images(images: Any, where: str) -> list[bytes]:
    """Ollama's images: base64 strings (bytes of a PNG, JPEG, ...)."""
    if not isinstance(images, list):
        raise APIError(400, f"{where} must be a list of base64 strings")
    out = []
    for k, b in enumerate(images):
        try:
            out.append(base64.b64decode(b, validate=True))
        except (TypeError, ValueError, binascii.Error):
            raise APIError(400, f"{where}[{k}] is not a base64 string") from None
    return out


def _with_images(m: dict, images: Any, where: str) -> dict:
    """A message with Ollama's images as OpenAI image parts before its text (as Ollama places them)."""
    if not images:
        return m
    if not isinstance(m.get("content"), str):
        raise APIError(400, f"{where}: a message with images needs a string content")
    parts = [{"type": "image", "image": b} for b in _images(images, where)]
    return dict(m, content=parts + ([{"type": "text", "text": m["content"]}] if m["content"] else []))


def _kwargs(s: Session, body: _GenBody, messages: list[dict] | None, tools: list[dict] | None = None,
            adapter: str | None = None) -> dict:
    """Session keyword arguments, through the OpenAI route's ChatRequest (the same checks)."""
    fmt = body.format
    if fmt in (None, ""):
        rf = None
    elif fmt == "json":
        rf = {"type": "json_object"}
    elif isinstance(fmt, dict):
        rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise APIError(400, 'format must be "json" or a JSON schema object')
    req = ChatRequest(model=body.model, messages=messages or [], **(body.options or Options()).sampling(),
                      response_format=rf, tools=tools or None, chat_template_kwargs=_think(s, body, messages),
                      logprobs=body.logprobs, top_logprobs=body.top_logprobs)
    return req.session_kwargs(s.model.tokenizer) | req.adapter_kwargs(list(s.adapters), adapter)


def _think(s: Session, body: _GenBody, messages) -> dict | None:
    """think: the template's enable_thinking (and gpt-oss's reasoning_effort for a level).
    Unset, the template's default holds; either way the thinking comes apart, in `thinking`."""
    think = body.think
    if think is None or (think is False and messages is None):
        return None
    if messages is None:
        raise APIError(400, "think needs a chat template (and raw left out)")
    if think is not False and reasoning.detect(s.model.chat_template) is None:
        raise APIError(400, f'"{body.model}" does not support thinking')
    if isinstance(think, str):
        if think not in ("low", "medium", "high"):
            raise APIError(400, f'think must be true, false, "low", "medium" or "high", got {think!r}')
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


# ---- answers ----------------------------------------------------------------------------

def _chat_shape(text: str, thinking: str, calls: list[dict] | None) -> dict[str, Any]:
    msg: dict[str, Any] = dict(role="assistant", content=text)
    if thinking:
        msg["thinking"] = thinking
    if calls:  # Ollama's: arguments as an object, not a JSON string
        msg["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                             for c in calls]
    return dict(message=msg)


def _gen_shape(text: str, thinking: str, calls) -> dict[str, Any]:
    return dict(response=text, **({"thinking": thinking} if thinking else {}))


async def _answer(request: Request, s: Session, body: _GenBody, kw: dict, inputs: dict, shape):
    """One reply, or NDJSON lines (Ollama's default): a line per piece, then one with
    done=true and the counts and durations (nanoseconds)."""
    t0 = time.perf_counter_ns()
    tok, k = s.model.tokenizer, body.top_logprobs or 0

    def head() -> dict[str, Any]:
        return dict(model=body.model, created_at=_iso(time.time()))

    def lps(chunks) -> dict[str, Any]:
        if not body.logprobs:
            return {}
        return dict(logprobs=[e for c in chunks for e in logprob_entries(tok, c.token_ids, c.top_logprobs, k)])

    def done(last, n_out: int, t_first: int) -> dict[str, Any]:
        t_end = time.perf_counter_ns()
        return dict(done=True, done_reason="length" if last.finish_reason == "length" else "stop",
                    total_duration=t_end - t0, load_duration=0, prompt_eval_count=last.prompt_tokens or 0,
                    prompt_eval_duration=t_first - t0, eval_count=n_out, eval_duration=t_end - t_first)
    stream = s.stream(inputs.pop("prompt", None), **inputs, **kw)
    if not body.stream:
        async def collect():
            chunks, t_first = [], None
            async for c in stream:
                t_first = t_first or time.perf_counter_ns()
                chunks.append(c)
            return chunks, t_first
        chunks, t_first = await until_disconnect(request, collect())
        text, thinking = "".join(c.text for c in chunks), "".join(c.reasoning for c in chunks)
        n_out = sum(len(c.token_ids) for c in chunks)
        return {**head(), **shape(text, thinking, chunks[-1].tool_calls), **done(chunks[-1], n_out, t_first),
                **lps(chunks)}
    first = await until_disconnect(request, anext(stream))  # a refused request gets its own status code
    t_first = time.perf_counter_ns()

    async def lines():
        c, n_out = first, 0
        try:
            while True:
                n_out += len(c.token_ids)
                if c.text or c.reasoning or c.tool_calls or (body.logprobs and c.token_ids):
                    yield _line({**head(), **shape(c.text, c.reasoning, c.tool_calls), "done": False, **lps([c])})
                if c.finish_reason:
                    break
                c = await anext(stream)
            yield _line({**head(), **shape("", "", None), **done(c, n_out, t_first)})
        except HearthError as e:  # the status is sent already: the error goes as a line
            yield _line({"error": str(e)})
        finally:
            await stream.aclose()  # aborts the engine request if it still runs (a client gone too)
    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _loaded(model: str, **shape) -> JSONResponse:
    return JSONResponse(dict(model=model, created_at=_iso(time.time()), **shape, done=True, done_reason="load"))


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


# ---- model facts ------------------------------------------------------------------------

def _n_params(s: Session) -> int:
    n = s.model.metadata.get("general.parameter_count")
    return int(n) if n else sum(prod(t.shape) for t in s.model.file.tensors.values())


def _details(s: Session) -> dict[str, Any]:
    n, arch = _n_params(s), s.model.arch_name
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    return dict(parent_model="", format="gguf", family=arch, families=[arch], parameter_size=size,
                quantization_level=_quant(s))


def _quant(s: Session) -> str:
    """general.file_type's name (Q4_K_M, ...), else the type holding most of the weights' bytes."""
    try:
        return gguf.LlamaFileType(s.model.metadata["general.file_type"]).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (KeyError, ValueError, TypeError):
        by_type = Counter()
        for t in s.model.file.tensors.values():
            by_type[t.ggml_type.name] += t.nbytes
        return by_type.most_common(1)[0][0] if by_type else "unknown"


def _capabilities(s: Session) -> list[str]:
    m = s.model
    caps = ["completion"] if m.causal else []
    if m.causal and m.chat_template:  # any template takes tools (described in a system turn if it ignores them)
        caps.append("tools")
    if m.causal and reasoning.detect(m.chat_template) is not None:
        caps.append("thinking")
    if not m.causal or m.metadata.get(f"{m.arch_name}.pooling_type"):
        caps.append("embedding")
    return caps


def _plain(v: Any, verbose: bool) -> Any:
    """A metadata value as JSON; long arrays (the vocabulary) empty unless verbose, as Ollama has it."""
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [] if len(v) > 64 and not verbose else list(v)
    return v.item() if isinstance(v, np.generic) else v


class OllamaErrors(ReshapeErrors):
    """Errors under /api/ in Ollama's {"error": "message"}."""
    prefix = "/api/"

    @staticmethod
    def reshape(status: int, error: dict) -> dict:
        return {"error": error["message"]}
