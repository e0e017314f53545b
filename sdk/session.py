"""The public Session: load a model, run its engine, and turn requests into awaitables and
async streams. Works under asyncio and trio (anyio)."""
from __future__ import annotations

import ctypes
import math
import threading
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import anyio
import gguf
import numpy as np

from hearthlm import act as _act
from hearthlm import gc_freeze
from hearthlm._wake import Channel, loop_waker
from hearthlm._wake import flush as wake_flush
from hearthlm.backends import get_backend
from hearthlm.core import errors as _errors
from hearthlm.core.errors import ContextLengthError, HearthError, InvalidRequestError, RequestTimeoutError, SessionClosedError
from hearthlm.core.log import get_logger
from hearthlm.model_zoo import reasoning
from hearthlm.model_zoo.adapters import load_adapter
from hearthlm.model_zoo.chat_template import MEDIA_MARKER, chat_media, split_media
from hearthlm.model_zoo.hub import log_progress
from hearthlm.model_zoo.model import Model, load_model
from hearthlm.model_zoo.resolve import DEFAULT_MODEL, resolve_model
from hearthlm.model_zoo.template_limits import DEFAULT_LIMITS, TemplateLimits
from hearthlm.model_zoo.tokenizer import MEDIA_ID, vocab_mismatch
from hearthlm.options import SessionOptions, check_names, takes_options
from hearthlm.output import ChoiceOutput, ChunkJoin, with_prompt
from hearthlm.runtime import constraint
from hearthlm.runtime.devices import open_device
from hearthlm.runtime.engine import Engine
from hearthlm.runtime.placement import offload
from hearthlm.runtime.request import Kind, Media, Request, ThinkBudget, grid_positions, placeholder_ids
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.runtime.weight_cache import WeightCache, cache_dir
from hearthlm.tools import ToolOutput, ToolPlan
from hearthlm.types import Chunk, Completion

log = get_logger("hearthlm.session")

# per-request limits, checked before any work (a request past them is refused, not truncated)
MAX_MESSAGES = 10_000
MAX_STOPS = 64            # stop strings per request
MAX_STOP_CHARS = 1_000    # characters per stop string (each is searched for at every token)
PROMPT_CHARS_PER_TOKEN = 32  # a prompt text longer than this many characters per context token cannot fit
OFF_LOOP_CHARS = 4_096    # prompts longer than this are tokenized in a worker thread, not on the event loop
MAX_CHOICES = 16          # n per request
# template variables hearthlm sets itself: chat_template_kwargs may not override them
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "limits",
                                    "max_chars", "raise_exception", "strftime_now"})
POOLINGS = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # GGUF {arch}.pooling_type; 0 (none) or absent: mean


def _prompt_dir(on: bool, directory, weight_cache) -> Path | None:
    """Where persisted prompt prefixes go: `directory`, else `prompts/` beside the packed
    weights (under the default cache directory when those are off); None when turned off."""
    if not on:
        return None
    if directory is not None:
        return Path(directory)
    return cache_dir(None if weight_cache is False else weight_cache, "prompts")


class Session:
    """One loaded model and its engine. Open with `async with Session.open(...) as s`."""

    def __init__(self, model: Model, engine: Engine, template_limits: TemplateLimits = DEFAULT_LIMITS) -> None:
        self.model = model
        self.engine = engine
        self.template_limits = template_limits
        self._closed = False
        self._frozen = False  # froze the collector at open (gc_freeze): thaws it at close
        self._vocab: constraint.Vocabulary | None = None  # llguidance's view, built on first use
        self._vocab_lock = threading.Lock()
        self._head: np.ndarray | None = None  # a decoder reranker's head, dequantized on first use
        self._draft_file: Model | None = None  # the draft model's file, closed with the session
        self.vision = None  # model_zoo.vision.clip.VisionModel: the mmproj, where the model sees images
        self._media_opts = SessionOptions()  # image limits and remote fetching

    # ---- lifecycle -------------------------------------------------------------------
    @classmethod
    @takes_options
    def open(cls, model: str = DEFAULT_MODEL, *, options: SessionOptions | None = None, **kwargs):
        """Async context manager yielding a ready Session. `model`: a .gguf path, a Hub repo
        id (`filename` picks the file, a glob), or a model-zoo name. The options: a
        SessionOptions as `options=`, or its fields as keywords (which win over `options`);
        they are checked on entering (InvalidRequestError naming the option). A Hub model not
        in the cache is downloaded first. Leaving the context closes the session."""
        check_names(kwargs)

        @asynccontextmanager
        async def _cm():
            o = SessionOptions.of(options, kwargs)
            s = await anyio.to_thread.run_sync(lambda: cls._load(model, o))
            s.template_limits = o.template_limits
            if o.gc_freeze:
                await anyio.to_thread.run_sync(gc_freeze.freeze)
                s._frozen = True
            try:
                yield s
            finally:
                await s.aclose(abort=o.abort_on_close)
        return _cm()

    @classmethod
    def _load(cls, model: str, o: SessionOptions) -> "Session":
        n_ctx, kv_cache_type, n_gpu_layers, progress = o.n_ctx, o.kv_cache_type, o.n_gpu_layers, o.progress
        engine_opts = dict(max_batch_tokens=o.max_batch_tokens, max_seqs=o.max_seqs,
                           max_queued_requests=o.max_queued_requests, fusion=o.fusion,
                           prompt_cache_dir=_prompt_dir(o.prompt_cache, o.prompt_cache_dir, o.weight_cache),
                           prompt_cache_bytes=o.prompt_cache_bytes,
                           rollback_slots=o.rollback_slots if o.rollback_slots is not None else 16 if o.draft_model else 4)
        backends = ({o.backend: get_backend(o.backend)} if o.device is None
                    else open_device(o.device, n_gpu_layers, get_backend))
        if o.chat_template is not None:  # compiled first: a syntax error fails the open (naming the line), nothing loaded
            from hearthlm.model_zoo.chat_template import compile_template
            compile_template(o.chat_template)
        path = resolve_model(model, filename=o.filename, progress=progress or log_progress(log),
                             mmproj=o.mmproj is None)
        m = load_model(path)
        if o.chat_template is not None:
            m.chat_template = o.chat_template
        if hasattr(m.arch, "bind"):  # it runs on a target's state: alone it has no input
            m.close()
            raise _errors.ModelLoadError(f"{path}: a {m.arch_name} model drafts for its target: pass it as draft_model=")
        dm = vision = None
        try:  # the layers over the backends, once their count is known
            for name, apath in (o.adapters or {}).items():
                m.adapters.add(load_adapter(apath, name, m))
            vision = _open_vision(m, path, o.mmproj)
            placement = offload(backends, m.config.n_layer, n_gpu_layers)
            n_ctx = min(n_ctx, m.config.n_ctx_train)
            m.set_context(n_ctx)
            if not m.causal:  # an encoder runs each input in one step: a whole context must fit one
                engine_opts["max_batch_tokens"] = max(engine_opts["max_batch_tokens"], n_ctx)
            kv_tokens = o.kv_cache_tokens or 4 * n_ctx
            wdir = cache_dir(o.weight_cache)
            draft = None
            if o.draft_model is not None:
                dm = load_model(resolve_model(o.draft_model, filename=o.draft_filename,
                                              progress=progress or log_progress(log)))
                draft = cls._draft(m, dm, offload(backends, dm.config.n_layer, n_gpu_layers), n_ctx=n_ctx,
                                   kv_blocks=math.ceil(kv_tokens / 16), wdir=wdir, kv_cache_type=kv_cache_type,
                                   p_min=float(o.draft_p_min), **engine_opts)
            mtp = _mtp(m, placement, n_ctx=n_ctx, kv_blocks=math.ceil(kv_tokens / 16), kv_cache_type=kv_cache_type,
                       p_min=float(o.draft_p_min), **{k: v for k, v in engine_opts.items()
                                                      if k in ("max_batch_tokens", "max_seqs", "fusion")})
            engine = Engine(m, placement, n_ctx=n_ctx, kv_blocks=math.ceil(kv_tokens / 16),
                            weight_cache=WeightCache(wdir, m.file.identity()) if wdir else None,
                            kv_cache_type=kv_cache_type, draft=draft, vision=vision, mtp=mtp,
                            image_cache_bytes=o.image_cache_bytes, after_callbacks=wake_flush, **engine_opts)
        except BaseException:
            for f in (m, dm, vision):
                if f is not None:
                    f.close()
            raise
        engine.start()
        s = cls(m, engine)
        s._draft_file, s.vision, s._media_opts = dm, vision, o
        return s

    @staticmethod
    def _draft(m: Model, dm: Model, placement, *, n_ctx: int, kv_blocks: int, wdir, kv_cache_type: str,
               p_min: float, **engine_opts):
        """The draft model (its own runner and KV memory; the target's thread runs its steps)."""
        from hearthlm.runtime.draft import DraftModel
        if why := vocab_mismatch(m.tokenizer, dm.tokenizer):
            raise InvalidRequestError(f"the draft model cannot draft for this model: {why}")
        if hasattr(dm.arch, "bind"):  # an assistant that runs on the target's state (Gemma 4's)
            return _assistant(m, dm, p_min)
        if not dm.causal:
            raise InvalidRequestError("the draft model must be a decoder: an encoder does not generate")
        dm.set_context(min(n_ctx, dm.config.n_ctx_train))
        opts = {k: v for k, v in engine_opts.items() if k in ("max_batch_tokens", "max_seqs", "fusion", "rollback_slots")}
        return DraftModel(dm, placement, n_ctx=min(n_ctx, dm.config.n_ctx_train), kv_blocks=kv_blocks,
                          weight_cache=WeightCache(wdir, dm.file.identity()) if wdir else None,
                          kv_cache_type=kv_cache_type, p_min=p_min, n_vocab=m.n_vocab, **opts)

    async def aclose(self, *, abort: bool = True) -> None:
        """Stop the engine: in-flight requests are aborted (abort=True) or run to the end."""
        if self._closed:
            return
        self._closed = True
        await anyio.to_thread.run_sync(_closer(self.engine, abort))
        self.model.close()
        for f in (self._draft_file, self.vision):
            if f is not None:
                f.close()
        if self._frozen:
            self._frozen = False
            await anyio.to_thread.run_sync(gc_freeze.thaw)
        _give_back()

    # ---- LoRA adapters ---------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters loaded, name -> path."""
        return self.model.adapters.paths()

    async def load_adapter(self, name: str, path) -> None:
        """Load a LoRA adapter (GGUF) under `name`, for requests to choose (adapters={name: scale});
        one already under that name is replaced (requests using it finish with it). ModelLoadError
        naming the problem where the file is not a LoRA for this model."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"an adapter name must be a non-empty string, not {name!r}")
        if self._closed:
            raise SessionClosedError("the session is closed")
        ad = await anyio.to_thread.run_sync(lambda: load_adapter(path, name, self.model))
        self.model.adapters.add(ad)

    def unload_adapter(self, name: str) -> None:
        """Unload a LoRA adapter: new requests can no longer choose it; its memory goes once the
        requests using it end. InvalidRequestError for a name not loaded."""
        self.model.adapters.remove(name)

    # ---- text ------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return self.model.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.model.tokenizer.decode(list(ids))

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def health(self) -> dict[str, Any]:
        """{"ok": bool, "error": str | None, "closing": bool}: ok while the engine serves."""
        return self.engine.health()

    async def _prompt_ids_off_loop(self, prompt, messages, tools: ToolPlan | None = None,
                                   template_kwargs: dict | None = None, generation_prompt: bool = True,
                                   media: bool = False) -> list[int]:
        """Chat templates (their rendering time is the file's, not ours) and long prompts are
        prepared in a worker thread, so the application's event loop keeps running."""
        big = messages is not None or (isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS) or \
            (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > OFF_LOOP_CHARS)
        if big:
            return await anyio.to_thread.run_sync(self._prompt_ids, prompt, messages, tools, template_kwargs,
                                                  generation_prompt, media)
        return self._prompt_ids(prompt, messages, tools, template_kwargs, generation_prompt, media)

    def _prompt_ids(self, prompt, messages, tools: ToolPlan | None = None,
                    template_kwargs: dict | None = None, generation_prompt: bool = True,
                    media: bool = False) -> list[int]:
        """The prompt's token ids; media: tokenizer.MEDIA_ID at each image's place (MEDIA_MARKER)."""
        tok = self.model.tokenizer
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompt or messages=")
        max_chars = PROMPT_CHARS_PER_TOKEN * self.n_ctx
        if messages is not None:
            if not self.model.chat_template:
                raise InvalidRequestError("this model has no chat template; pass prompt= instead")
            if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
                raise InvalidRequestError(f"{len(messages)} messages; at most {MAX_MESSAGES} are taken")
            chars = sum(_chars(m.get("content")) for m in messages if isinstance(m, dict)) \
                if isinstance(messages, list) else 0
            if chars > max_chars:
                raise ContextLengthError(f"the messages hold {chars} characters: more than a context of "
                                         f"{self.n_ctx} tokens can take")
            from hearthlm.model_zoo.chat_template import encode_chat  # Jinja, loaded by the first chat
            messages, extra = tools.chat(messages, self.model.chat_template) if tools else (messages, {})
            extra = {**(template_kwargs or {}), **extra}
            return encode_chat(tok, self.model.chat_template, messages, limits=self.template_limits,
                               max_chars=max_chars, add_generation_prompt=generation_prompt, media=media, **extra)
        if isinstance(prompt, str):
            if len(prompt) > max_chars:
                raise ContextLengthError(f"the prompt has {len(prompt)} characters: more than a context of "
                                         f"{self.n_ctx} tokens can take")
            if media:
                return tok.encode_parts(split_media(prompt, True), add_special=True)
            return tok.encode(prompt, add_special=True, parse_special=True)
        if media:
            raise InvalidRequestError(f"images need a text prompt that marks each image's place with "
                                      f"{MEDIA_MARKER}, or messages= with image parts, not token ids")
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)) \
                or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of int token ids")
        return [int(t) for t in prompt]

    # ---- embeddings ------------------------------------------------------------------
    async def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *, normalize: bool = True,
                    pooling: str | None = None, truncate: bool = False) -> np.ndarray:
        """Embeddings, float32 (len(texts), n_embd): each text (or list of token ids) runs
        through the engine, batched with whatever else runs, and its final hidden states
        (a decoder's normed) are pooled ("mean", "cls": the first token, "last"; default: the
        GGUF's pooling_type, else mean), then L2-normalized unless normalize=False. No KV is
        kept. An input longer than the model takes is refused (ContextLengthError), or with
        truncate=True cut to fit (an encoder's closing [SEP] kept)."""
        pooling = pooling or self.default_pooling()
        if pooling == "rank":
            pooling = "cls" if not self.model.causal else "last"  # a reranker's embedding: its scored token
        if pooling not in POOLINGS.values():
            raise InvalidRequestError(f"pooling must be one of {sorted(POOLINGS.values())}, got {pooling!r}")
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise InvalidRequestError("no texts to embed")
        out = await self._pooled([await self._input_ids(t, truncate) for t in texts], Kind.EMBED, pooling)
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    async def rerank(self, query: str, documents: Sequence[str], *, truncate: bool = False) -> list[float]:
        """Relevance of each document to the query, in the documents' order: the reranker's
        classification head on "[CLS] query [SEP] document" (llama-server's pairing; the GGUF's
        rerank template where it has one), its raw output as llama.cpp reports it."""
        if not isinstance(query, str) or isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequestError("rerank takes a query string and a list of document strings")
        if not documents:
            raise InvalidRequestError("no documents to rank")
        if not self.has_rank_head():
            raise InvalidRequestError("this model has no classification head (cls.output.weight or a one-score "
                                      "cls.weight): it does not rerank")
        ids = [await self._input_ids(self.rerank_ids(query, d), truncate) for d in documents]
        if not self.model.causal:
            return [float(v[0]) for v in await self._pooled(ids, Kind.RANK)]
        # a decoder reranker (Qwen3-Reranker): its head's rows on the last token's normed state,
        # softmaxed; the score is the first label's probability ("yes"), as llama.cpp has it
        logits = (await self._pooled(ids, Kind.EMBED, "last")).astype(np.float64) @ self._rank_head().T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return [float(x) for x in p[:, 0] / p.sum(axis=1)]

    def has_rank_head(self) -> bool:
        """cls.output (bert rerankers, Qwen3-Reranker), or an encoder's one-score cls (jina-bert-v2's)."""
        w = self.model.weights
        return "cls.output.weight" in w or (not self.model.causal and "cls.weight" in w and w["cls.weight"].shape[0] == 1)

    def _rank_head(self) -> np.ndarray:
        if self._head is None:
            w = self.model.weights["cls.output.weight"]
            self._head = gguf.quants.dequantize(w.raw, w.ggml_type).reshape(w.shape).astype(np.float64)
        return self._head

    def rerank_ids(self, query: str, doc: str) -> list[int]:
        """The reranker's input for one pair (llama-server's format_prompt_rerank)."""
        tok = self.model.tokenizer
        template = self.model.metadata.get("tokenizer.chat_template.rerank")
        if isinstance(template, str):
            return tok.encode(template.replace("{query}", query).replace("{document}", doc), parse_special=True)
        q, d = tok.encode(query), tok.encode(doc)
        eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
        if tok.add_sep and tok.sep_id is None or tok.add_eos and eos is None:
            raise InvalidRequestError("this model's tokenizer separates a rerank pair with a token its file does not name "
                                      "(tokenizer.ggml.seperator_token_id / eos_token_id)")
        return ([tok.bos_id] if tok.add_bos else []) + q + ([eos] if tok.add_eos else []) \
            + ([tok.sep_id] if tok.add_sep else []) + d + ([eos] if tok.add_eos else [])

    async def _input_ids(self, text, truncate: bool) -> list[int]:
        ids = await self._prompt_ids_off_loop(text, None)
        limit = self.n_ctx if not self.model.causal else self.n_ctx - 1
        if truncate and len(ids) > limit:
            sep = self.model.tokenizer.kind == "wpm" and ids[-1] == self.model.tokenizer.sep_id
            ids = ids[:limit - 1] + [ids[-1]] if sep else ids[:limit]
        return ids

    async def _pooled(self, ids: list[list[int]], kind: Kind, pooling: str | None = None) -> np.ndarray:
        """Run each input as an embedding (by `pooling`) or ranking request; (len(ids), width)
        float32 in their order."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        chan = Channel(loop_waker())
        reqs = [Request(prompt=p, params=SamplingParams(), max_tokens=0, on_token=_no_token, kind=kind, pooling=pooling,
                        on_finish=lambda reason, err, i=i: chan.put((i, reason, err))) for i, p in enumerate(ids)]
        pending: set[int] = set()
        window = self.engine.max_seqs  # submitted a batch at a time: a long list does not fill the queue
        try:
            for i, req in enumerate(reqs):
                while len(pending) >= window:
                    self._embed_done(await chan.get_all(), pending)
                self.engine.submit(req)
                pending.add(i)
            while pending:
                self._embed_done(await chan.get_all(), pending)
        finally:
            for i in pending:
                self.engine.abort(reqs[i].id)
        return np.stack([r.pooled for r in reqs]).astype(np.float32)

    def default_pooling(self) -> str:
        """The pooling the GGUF names ({arch}.pooling_type), mean where it names none."""
        kind = self.model.metadata.get(f"{self.model.arch_name}.pooling_type") or 0
        if kind and kind not in POOLINGS:
            raise InvalidRequestError(f"the model's pooling_type {kind} is not supported")
        return POOLINGS.get(kind, "mean")

    @staticmethod
    def _embed_done(items, pending: set[int]) -> None:
        for i, reason, err in items:
            pending.discard(i)
            if err is not None:
                raise err
            if reason == "closed":
                raise SessionClosedError("the session was closed while the request ran")
            if reason != "stop":
                raise HearthError(f"the embedding request ended with {reason!r}")

    def _vocabulary(self) -> constraint.Vocabulary:
        with self._vocab_lock:
            if self._vocab is None:
                tok = self.model.tokenizer
                self._vocab = constraint.Vocabulary(tok.vocab_bytes(), self.model.eog_ids, tok.encode_text,
                                                    self.model.n_vocab)
            return self._vocab

    def _matcher(self, grammar: tuple[str, str]) -> constraint.Matcher:
        """(grammar, what it is) checked against this model's vocabulary (InvalidRequestError
        naming the problem)."""
        return constraint.Matcher(self._vocabulary(), *grammar)

    # ---- generation ------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs) -> Completion:
        """Generate a completion. Arguments as `stream` (n: use generate_n)."""
        if kwargs.pop("n", 1) != 1:
            raise InvalidRequestError("generate returns one completion: use generate_n for n > 1")
        return (await self.generate_n(prompt, n=1, **kwargs))[0]

    async def generate_n(self, prompt: str | Sequence[int] | None = None, *, n: int, **kwargs) -> list[Completion]:
        """n completions of one prompt (OpenAI's n): the prompt is computed once and its KV shared;
        each choice samples its own stream (choice i's seed is seed + i). Arguments as `stream`."""
        parts = [ChunkJoin() for _ in range(n if isinstance(n, int) and n > 0 else 1)]
        n_prompt, prompt_lps = 0, None
        async for c in self._stream(prompt, n=n, **kwargs):
            if isinstance(c, int):
                n_prompt = c
                continue
            parts[c.index].add(c)
            prompt_lps = c.prompt_logprobs or prompt_lps
        return [p.completion(n_prompt, prompt_lps) for p in parts]

    async def stream(self, prompt: str | Sequence[int] | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Yield Chunks as tokens come. Keyword arguments: messages, max_tokens, temperature,
        top_k, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty, seed,
        stop (strings), stop_token_ids, min_tokens (no end-of-generation, stop token or stop
        string before that many), ignore_eos, logit_bias ({token id: bias}; -inf bans),
        top_logprobs, prompt_logprobs (k: the first chunk carries every prompt token's logprob
        and its k most likely alternatives), timeout; response_format (OpenAI's json_object /
        json_schema, or {"type": "regex", "pattern"} / {"type": "grammar", "grammar": Lark});
        tools and tool_choice (OpenAI's shapes; with messages=): the calls come in the last
        chunk, whose finish_reason is then "tool_calls"; n (chunks carry .index); with messages=,
        chat_template_kwargs (template variables, e.g. {"enable_thinking": False}), and for
        templates that think: the thinking comes apart in .reasoning (reasoning_format="none"
        leaves it in the text), reasoning_budget (tokens of thinking before it is closed for
        the model and the answer begins); adapters ({name: scale}: LoRA adapters the session
        holds, several at once, as llama.cpp's list; none: the base model; requests with
        different adapters are batched together)."""
        async for c in self._stream(prompt, **kwargs):
            if not isinstance(c, int):
                yield c

    async def act(self, *, messages: list[dict], tools: Sequence[Any], tool_choice: Any = None, max_rounds: int = 8,
                  tool_timeout: float | None = None, **kwargs) -> Completion:
        """Run the tool loop: generate; when the model calls tools, call them and feed their
        results back (an assistant turn with tool_calls, then role "tool" turns), until it
        answers in text or after max_rounds generations. tools: callables (sync ones run in a
        worker thread; their schema from type hints and docstring), hearthlm.act.tool(...)
        (a timeout per tool, a spec given) or (OpenAI function spec, callable) pairs, or an
        MCP server's (hearthlm.mcp). tool_choice applies to the first round, later ones are
        "auto". A failing tool (raises, times out after tool_timeout s, returns what JSON
        cannot hold, gets arguments that do not fit) is reported to the model as an error
        result, never raised. Returns the last round's Completion with .messages the whole
        exchange; its finish_reason is "max_rounds" when the model still called tools in
        the last round (their results are then the last messages: pass .messages to act
        again to go on). Other keyword arguments as `stream`, for every round."""
        return await _act.act(self, messages=messages, tools=tools, tool_choice=tool_choice, max_rounds=max_rounds,
                              tool_timeout=tool_timeout, **kwargs)

    def act_stream(self, *, messages: list[dict], tools: Sequence[Any], tool_choice: Any = None, max_rounds: int = 8,
                   tool_timeout: float | None = None, **kwargs) -> AsyncIterator[_act.Event]:
        """`act` as events, in order: TextDelta (answer or thinking text as it comes), then per
        round with calls: ToolCall for each, ToolResult for each (in the calls' order), and
        last Done with the final Completion (hearthlm.act's event classes)."""
        return _act.act_stream(self, messages=messages, tools=tools, tool_choice=tool_choice, max_rounds=max_rounds,
                               tool_timeout=tool_timeout, **kwargs)

    async def score(self, prompt: str | Sequence[int]) -> np.ndarray:
        """The log-probability of each prompt token after the first, given those before it
        (float64, len(tokens) - 1): a text's likelihood, as lm-evaluation-harness's loglikelihood
        and perplexity read it. A string is tokenized as generate() does (BOS added where the
        model adds one); token ids are taken as they are. Nothing is generated."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        ids = await self._prompt_ids_off_loop(prompt, None)
        if len(ids) < 2:
            raise InvalidRequestError("scoring needs a prompt of at least two tokens")
        req = await self._run_prompt_only(ids, kind=Kind.SCORE, prompt_logprobs=0)
        return np.array([lp for lp, _ in req.prompt_lps], np.float64)

    async def cache_prefix(self, prompt: str | Sequence[int] | None = None, *,
                           messages: list[dict] | None = None, images: Sequence[Any] | None = None) -> int:
        """Compute a prefix's KV now and persist it in the prompt cache (see Session.open's
        prompt_cache): a later prompt, in this process or another, that begins with it takes
        those blocks instead of computing them. For `messages=`, the prefix is the rendered
        chat up to the end of the last message (no generation prompt). Returns the tokens
        written to disk: whole KV blocks of the prefix (0 with no prompt cache, where the
        prefix is only held in memory as any prompt's is). Images as in `stream`: the files'
        blocks carry each image's identity, so only a prompt with the same images finds them."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        if not self.model.causal:
            raise InvalidRequestError("this model is an encoder: it keeps no KV to cache")
        messages, sources = self._media_sources(prompt, messages, images)
        ids = await self._prompt_ids_off_loop(prompt, messages, generation_prompt=False, media=bool(sources))
        media: list[Media] = []
        if sources:
            ids, media = await anyio.to_thread.run_sync(self._place_images, ids, sources)
        req = await self._run_prompt_only(ids, kind=Kind.PREFILL, media=media)
        return req.persisted

    async def _run_prompt_only(self, ids: list[int], **fields) -> Request:
        """Run a request that computes the prompt and generates nothing; returns it finished."""
        chan = Channel(loop_waker())
        req = Request(prompt=ids, params=SamplingParams(temperature=0.0), max_tokens=0, on_token=_no_token,
                      on_finish=lambda reason, err: chan.put((reason, err)), **fields)
        self.engine.submit(req)
        try:
            (reason, err), = await chan.get_all()
        finally:
            self.engine.abort(req.id)
        if err is not None:
            raise err
        if reason != "stop":
            raise SessionClosedError("the session was closed while the request ran") if reason == "closed" \
                else HearthError(f"the request ended with {reason!r}")
        return req

    async def _stream(self, prompt, *, messages=None, max_tokens: int | None = None,
                      stop: str | Sequence[str] | None = None, timeout: float | None = None,
                      response_format: dict | None = None, tools: list[dict] | None = None,
                      tool_choice: str | dict | None = None, n: int = 1, prompt_logprobs: int | None = None,
                      chat_template_kwargs: dict | None = None, reasoning_budget: int | None = None,
                      reasoning_format: str = "auto", images: Sequence[Any] | None = None,
                      adapters: dict[str, float] | None = None, **sampling) -> AsyncIterator[Chunk | int]:
        if self._closed:
            raise SessionClosedError("the session is closed")
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise InvalidRequestError(str(e)) from e
        score_only = max_tokens == 0 and prompt_logprobs is not None  # the prompt's log-probs, nothing generated
        max_tokens, stops, timeout = _check_limits(None if score_only else max_tokens, stop, timeout)
        max_tokens = 0 if score_only else max_tokens
        _check_choice_args(n, prompt_logprobs, reasoning_budget, reasoning_format, params, self.model.n_vocab)
        if self.model.tokenizer.suppress_ids:  # the file's banned ids (Gemma 4 12B's), as llama.cpp's samplers ban them
            params = replace(params, logit_bias=params.logit_bias + tuple(
                (t, -math.inf) for t in self.model.tokenizer.suppress_ids))
        template_kwargs = _check_template_kwargs(chat_template_kwargs, messages)
        lora = self.model.adapters.resolve(adapters)
        grammar = constraint.grammar_from_response_format(response_format) if response_format is not None else None
        plan = ToolPlan.make(self.model, tools, tool_choice)
        if plan is not None:
            if messages is None:
                raise InvalidRequestError("tools need messages=, not a prompt")
            forced = plan.grammar(self.model.tokenizer)
            if forced is not None and grammar is not None:
                raise InvalidRequestError("pass response_format or a forced tool_choice, not both")
            grammar = (constraint.lark_grammar(forced), "tool-call grammar") if forced is not None else grammar
        ids, media, think, opened = await self._prompt(prompt, messages, images, plan, template_kwargs, reasoning_budget)
        tok = self.model.tokenizer
        # compiled against the vocabulary off the event loop (the first one builds the vocabulary)
        matchers = [await anyio.to_thread.run_sync(self._matcher, grammar) if grammar is not None else None
                    for _ in range(n)]
        chan = Channel(loop_waker())
        limit = max_tokens if max_tokens is not None else max(self.n_ctx - len(ids), 0)
        reqs = [Request(prompt=ids, matcher=matchers[i], max_tokens=limit, kind=Kind.SCORE if score_only else Kind.GENERATE,
                        media=media, lora=lora,
                        params=replace(params, seed=params.seed + i) if i and params.seed is not None else params,
                        on_token=lambda t, lp, i=i: chan.put((i, t, lp)),
                        on_finish=lambda reason, err, i=i: chan.put((i, reason, err)),
                        prompt_logprobs=prompt_logprobs if i == 0 else None,
                        think=ThinkBudget(reasoning_budget, think.open.encode(), think.close.encode(),
                                          tok.encode(think.feed_close, parse_special=True),
                                          partial(tok.token_bytes, special=True), thinking=opened)
                        if think is not None and reasoning_budget is not None else None)
                for i in range(n)]
        outs = [ChoiceOutput(tok, ids, index=i, stops=stops, min_tokens=params.min_tokens,
                             splitter=reasoning.ReasoningSplitter(think, opened=opened)
                             if think is not None and reasoning_format == "auto" else None,
                             tools=ToolOutput(plan) if plan is not None else None) for i in range(n)]
        deadline = anyio.current_time() + timeout if timeout is not None else math.inf
        unheld = [self._hold_adapters(r) for r in reqs]  # each: once, at the end of its request
        try:
            self.engine.submit(reqs[0])  # the others once its prompt is computed: they find its KV blocks
        except BaseException:
            for u in unheld:
                u()
            raise
        submitted, first = 1, True
        try:
            yield len(ids)
            while not all(o.done for o in outs):
                items = None
                with anyio.move_on_after(deadline - anyio.current_time()):  # no yield inside
                    items = await chan.get_all()
                if items is None:
                    raise RequestTimeoutError(f"the request did not finish within {timeout} s")
                by_choice: dict[int, list[tuple]] = {}
                for i, a, b in items:
                    if isinstance(a, str) and b is not None:
                        raise b
                    if a == "closed":
                        raise SessionClosedError("the session was closed while the request ran")
                    by_choice.setdefault(i, []).append((a, b))
                if submitted < n and 0 in by_choice:
                    for r in reqs[1:]:
                        self.engine.submit(r)
                    submitted = n
                for i, got in by_choice.items():
                    c = outs[i].take(got)
                    if outs[i].stopped:
                        self.engine.abort(reqs[i].id)
                    if c is None:
                        continue
                    if i == 0 and first and prompt_logprobs is not None:
                        c = replace(c, prompt_logprobs=[(ids[0], None, None)] + [
                            (t, lp, tops) for t, (lp, tops) in zip(ids[1:], reqs[0].prompt_lps)])
                    first = first and i != 0
                    yield with_prompt(c, len(ids))
        finally:
            for o, r in zip(outs[:submitted], reqs):
                if not o.done or o.stopped:
                    self.engine.abort(r.id)
            for u in unheld[submitted:]:  # never submitted: no on_finish comes
                u()

    def _hold_adapters(self, req: Request):
        """Hold the request's LoRA adapters (an unloaded one stays until released); released when the
        request finishes (its on_finish, on the engine thread) or by calling what this returns."""
        if not req.lora:
            return lambda: None
        sets, done = self.model.adapters, []
        sets.hold(req.lora)

        def release() -> None:
            if not done:
                done.append(True)
                sets.release(req.lora)
        finish = req.on_finish

        def on_finish(reason, err) -> None:
            release()
            finish(reason, err)
        req.on_finish = on_finish
        return release

    async def _prompt(self, prompt, messages, images, plan, template_kwargs, reasoning_budget):
        """(ids, media, think, opened): the prompt as the engine gets it, images placed; think: the
        template's reasoning markers, opened: whether the prompt leaves the thinking open."""
        messages, sources = self._media_sources(prompt, messages, images)
        ids = await self._prompt_ids_off_loop(prompt, messages, plan, template_kwargs, media=bool(sources))
        media: list[Media] = []
        if sources:  # decoded, preprocessed and placed off the event loop
            ids, media = await anyio.to_thread.run_sync(self._place_images, ids, sources)
        think = reasoning.detect(self.model.chat_template) if messages is not None else None
        opened = think is not None and reasoning.opened_by_prompt(think, self._tail_text(ids))
        if think is not None and opened and reasoning_budget == 0:  # no thinking: closed in the prompt
            ids, opened = ids + self.model.tokenizer.encode(think.feed_close, parse_special=True), False
        return ids, media, think, opened

    async def count_tokens(self, prompt: str | Sequence[int] | None = None, *, messages=None, tools=None,
                           tool_choice=None, chat_template_kwargs: dict | None = None,
                           reasoning_budget: int | None = None, images: Sequence[Any] | None = None) -> int:
        """The prompt's length in tokens as `stream` with these arguments would compute it (the
        template, tools and images placed); nothing is generated."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        plan = ToolPlan.make(self.model, tools, tool_choice)
        if plan is not None and messages is None:
            raise InvalidRequestError("tools need messages=, not a prompt")
        template_kwargs = _check_template_kwargs(chat_template_kwargs, messages)
        ids, *_ = await self._prompt(prompt, messages, images, plan, template_kwargs, reasoning_budget)
        return len(ids)

    # ---- images ----------------------------------------------------------------------
    def _media_sources(self, prompt, messages, images) -> tuple[Any, list[Any]]:
        """The images of a request, in order: `images=` (with a prompt) or messages' image parts;
        the messages with each image part as MEDIA_MARKER."""
        if images is not None and not isinstance(images, (list, tuple)):
            raise InvalidRequestError(f"images must be a list, not {type(images).__name__}")
        sources = list(images or ())
        if messages is not None:
            messages, in_parts = chat_media(messages)
            if sources and in_parts:
                raise InvalidRequestError("pass images as messages' image parts or as images=, not both")
            if sources and MEDIA_MARKER not in str(messages):
                raise InvalidRequestError(f"images= with messages needs {MEDIA_MARKER} in a message's content "
                                          "for each image; or give them as image parts")
            sources = sources or in_parts
        if not sources:
            return messages, []
        if self.vision is None:
            raise InvalidRequestError("this model has no vision projector (mmproj) loaded, so it cannot take "
                                      "images: open the session with mmproj=PATH")
        lim = self._media_opts
        if len(sources) > lim.max_images:
            raise InvalidRequestError(f"{len(sources)} images; a request may bring at most {lim.max_images}")
        return messages, sources

    def _place_images(self, ids: list[int], sources: list[Any]) -> tuple[list[int], list[Media]]:
        """Each MEDIA_ID in ids becomes the image's layout as mtmd_tokenize makes it (VisionModel.layout):
        the projector's markers (text, or tokens found by their text) around each of its image chunks
        (the image, or its tiles and overview), a chunk's rows as placeholder ids; the images decoded and
        preprocessed, one Media per chunk; under an M-RoPE text model each chunk's rows placed on its grid
        (mtmd's M-RoPE positions)."""
        from hearthlm.model_zoo.vision.clip import Piece
        from hearthlm.model_zoo.vision.image import ImageLimits, load_image  # Pillow, loaded by the first image
        vm, tok, lim = self.vision, self.model.tokenizer, self._media_opts
        places = [i for i, t in enumerate(ids) if t == MEDIA_ID]
        if len(places) != len(sources):
            raise InvalidRequestError(f"the prompt marks {len(places)} image place(s) ({MEDIA_MARKER}) for "
                                      f"{len(sources)} image(s)")
        limits = ImageLimits(max_bytes=lim.max_image_bytes, max_pixels=lim.max_image_pixels)
        out: list[int] = []
        media: list[Media] = []
        last = 0
        for k, (at, src) in enumerate(zip(places, sources)):
            image = load_image(src, limits=limits, allow_remote=lim.allow_remote_media, name=f"image {k + 1}")
            out += ids[last:at]
            for part in vm.layout(image):
                if isinstance(part, str):  # a marker's text, special tokens parsed (mtmd's add_text)
                    out += tok.encode(part, parse_special=True)
                elif isinstance(part, Piece):  # checked at load (VisionModel.check_text_model)
                    out.append(tok.piece_id(part.text))
                else:
                    if part.n >= self.n_ctx:  # an image chunk is computed whole in one step: it must fit the context
                        raise ContextLengthError(f"image {k + 1} is {part.n} rows; the context holds {self.n_ctx} tokens")
                    positions, n_pos = grid_positions(*part.grid) if self.model.n_pos > 1 else (None, 0)
                    media.append(Media(len(out), part.n, part.key, part.pixels, bidirectional=vm.bidirectional,
                                       positions=positions, n_pos=n_pos))
                    out += placeholder_ids(part.key, part.n)
            last = at + 1
        return out + ids[last:], media

    def _tail_text(self, ids: list[int]) -> str:
        """The end of a rendered prompt as text, special tokens spelled out."""
        return b"".join(self.model.tokenizer.token_bytes(t, special=True) for t in ids[-8:]).decode("utf-8", "replace")


def _assistant(m: Model, dm: Model, p_min: float):
    """A draft model that runs on the target's state (Gemma 4's assistant), bound to this target:
    ModelLoadError naming what does not fit (architecture, hidden size, head sizes, vocabulary)."""
    from hearthlm.runtime.draft_heads import AssistantDrafter
    if dm.n_vocab != m.n_vocab:
        raise _errors.ModelLoadError(f"the assistant's vocabulary has {dm.n_vocab} tokens; this model's {m.n_vocab}")
    bound = replace(dm, config=dm.arch.bind(dm.config, m))
    return AssistantDrafter(bound, embd=m.weights["token_embd.weight"], scale=math.sqrt(m.config.n_embd),
                            p_min=p_min, n_vocab=m.n_vocab)


def _mtp(m: Model, placement, *, p_min: float, **opts):
    """The model's own multi-token-prediction block as a drafter (speculative="mtp"), where it has one:
    its K/V beside the output head."""
    if m.arch_name not in ("qwen35", "qwen35moe") or not getattr(m.config, "n_nextn", 0):
        return None
    from hearthlm.model_zoo.models import qwen35_mtp
    from hearthlm.runtime.draft_heads import MTPDrafter
    from hearthlm.runtime.placement import Placement
    head = qwen35_mtp.head(m)
    at = f"blk.{head.config.block}.nextn."
    if missing := [n for n in (at + "enorm.weight", at + "hnorm.weight") if n not in m.weights]:
        raise _errors.ModelLoadError(f"{m.path}: nextn_predict_layers is {m.config.n_nextn} but tensor {missing[0]!r} is missing")
    where = Placement({b: placement.backends[b] for b in (placement.host, placement.output)}, [placement.output])
    return MTPDrafter(head, where, embd=m.weights[qwen35_mtp.embeddings_of(head)], enorm=m.weights[at + "enorm.weight"],
                      hnorm=m.weights[at + "hnorm.weight"], p_min=p_min, **opts)


def _open_vision(m: Model, path, mmproj):
    """The model's vision projector: `mmproj` (a path), one found beside the model, or none."""
    if mmproj is False:
        return None
    from hearthlm.model_zoo.vision.clip import find_mmproj, load_mmproj
    found = Path(mmproj) if mmproj else find_mmproj(path)
    if found is None:
        return None
    vm = load_mmproj(found, n_embd_text=m.n_embd_inp)
    try:
        vm.check_text_model(m)
    except BaseException:
        vm.close()
        raise
    log.info("vision_projector", path=str(found), projector=vm.config.projector)
    return vm


def _chars(content: Any) -> int:
    """Characters of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def _check_limits(max_tokens, stop, timeout) -> tuple[int | None, list[str], float | None]:
    """Validate the per-request limits before anything is submitted."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidRequestError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        stops = []
    if not isinstance(stops, (list, tuple)) or any(not isinstance(x, str) or not x for x in stops):
        raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {stop!r}"[:300])
    if len(stops) > MAX_STOPS:
        raise InvalidRequestError(f"{len(stops)} stop strings; at most {MAX_STOPS} are taken")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        raise InvalidRequestError(f"a stop string of {max(len(x) for x in stops)} characters; "
                                  f"at most {MAX_STOP_CHARS} are taken")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidRequestError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return max_tokens, list(stops), timeout


def _check_choice_args(n, prompt_logprobs, reasoning_budget, reasoning_format, params: SamplingParams,
                       n_vocab: int) -> None:
    def count(name, v, lo, hi=None):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise InvalidRequestError(f"{name} must be an int in [{lo}, {hi if hi is not None else '...'}], got {v!r}")
    count("n", n, 1, MAX_CHOICES)
    if prompt_logprobs is not None:
        count("prompt_logprobs", prompt_logprobs, 0, 20)
    if reasoning_budget is not None:
        count("reasoning_budget", reasoning_budget, 0)
    if reasoning_format not in ("auto", "none"):
        raise InvalidRequestError(f"reasoning_format must be 'auto' or 'none', got {reasoning_format!r}")
    bad = [t for t, _ in params.logit_bias if t >= n_vocab]
    if bad:
        raise InvalidRequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{n_vocab - 1})")


def _check_template_kwargs(kw, messages) -> dict | None:
    if kw is None:
        return None
    if messages is None:
        raise InvalidRequestError("chat_template_kwargs need messages=, not a prompt")
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise InvalidRequestError("chat_template_kwargs must be a dict of template variable names to values")
    taken = sorted(RESERVED_TEMPLATE_VARS & kw.keys())
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {taken}: hearthlm sets them")
    return kw


def _no_token(tok: int, lp) -> None:  # embedding requests sample nothing
    raise AssertionError("an embedding request got a token")


def _closer(engine, abort: bool):
    """engine.close as a job for a worker thread that holds neither the engine nor the session
    once it has run (a worker keeps its last job until it takes the next)."""
    box = [engine]

    def close() -> None:
        box.pop().close(abort=abort)
    return close


def _give_back() -> None:
    """The heap pages a closed session freed go back to the system (glibc keeps them otherwise)."""
    trim = getattr(_libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


try:
    _libc = ctypes.CDLL(None)
except OSError:
    _libc = None
