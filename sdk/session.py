"""The public Session: load a model, run its engine, and turn requests into awaitables and
async streams. Works under asyncio and trio (anyio)."""
from __future__ import annotations

import math
import os
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

import anyio
import gguf
import numpy as np

from hearthlm._wake import Channel, loop_waker
from hearthlm.backends import get_backend
from hearthlm.model_zoo.hub import log_progress
from hearthlm.model_zoo.template_limits import DEFAULT_LIMITS, TemplateLimits
from hearthlm.model_zoo.model import Model, load_model
from hearthlm.model_zoo.resolve import DEFAULT_MODEL, resolve_model
from hearthlm.model_zoo.tokenizer import StreamDecoder
from hearthlm.runtime import constraint
from hearthlm.runtime.engine import Engine
from hearthlm.runtime.log import get_logger
from hearthlm.runtime.errors import (ContextLengthError, HearthError, InvalidRequestError, RequestTimeoutError,
                                     SessionClosedError)
from hearthlm.runtime.devices import open_device
from hearthlm.runtime.placement import offload
from hearthlm.runtime.request import Request
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
POOLINGS = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # GGUF {arch}.pooling_type; 0 (none) or absent: mean


class Session:
    """One loaded model and its engine. Open with `async with Session.open(...) as s`."""

    def __init__(self, model: Model, engine: Engine, template_limits: TemplateLimits = DEFAULT_LIMITS) -> None:
        self.model = model
        self.engine = engine
        self.template_limits = template_limits
        self._closed = False
        self._vocab: constraint.Vocabulary | None = None  # llguidance's view, built on first use
        self._vocab_lock = threading.Lock()
        self._head: np.ndarray | None = None  # a decoder reranker's head, dequantized on first use

    # ---- lifecycle -------------------------------------------------------------------
    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, *, backend: str = "cpu", device: str | None = None,
             n_gpu_layers: int | None = None, n_ctx: int = 2048,
             filename: str | None = None, kv_cache_tokens: int | None = None,
             max_batch_tokens: int = 512, max_seqs: int = 64, max_queued_requests: int = 1024,
             abort_on_close: bool = True, fusion: bool | None = None,
             template_limits: TemplateLimits = DEFAULT_LIMITS, progress=None,
             weight_cache: str | os.PathLike | bool | None = None):
        """Async context manager yielding a ready Session. `model`: a .gguf path, a Hub repo
        id (`filename` picks the file, a glob), or a model-zoo name. Leaving it aborts the
        requests still running (their callers get SessionClosedError), or with
        abort_on_close=False lets them finish first. `fusion=False` runs unfused graphs
        (debugging; None follows HEARTHLM_NO_FUSION). `backend` runs everything on one backend
        ("cpu", "reference", "cuda"); `device` ("cpu", "cuda", "auto": cuda where a GPU answers)
        with `n_gpu_layers` (None: all) puts the last n_gpu_layers layers and the output head
        on the GPU and the rest on the CPU, as llama.cpp's -ngl. `template_limits` bounds the
        chat template's rendering (time, steps, sizes): it is untrusted data from the file.
        A Hub model not in the cache is downloaded first: `progress(filename, done_bytes,
        total_bytes)` hears how far it got (default: logged, its start as a warning).
        `weight_cache`: where packed weights are kept between starts (a directory; False for
        nowhere; None: $HEARTHLM_CACHE_DIR, or the platform's cache directory)."""
        @asynccontextmanager
        async def _cm():
            s = await anyio.to_thread.run_sync(lambda: cls._load(
                model, backend=backend, device=device, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx,
                filename=filename, kv_cache_tokens=kv_cache_tokens,
                max_batch_tokens=max_batch_tokens, max_seqs=max_seqs, max_queued_requests=max_queued_requests,
                fusion=fusion, progress=progress, weight_cache=weight_cache))
            s.template_limits = template_limits
            try:
                yield s
            finally:
                await s.aclose(abort=abort_on_close)
        return _cm()

    @classmethod
    def _load(cls, model: str, *, backend: str, device: str | None, n_gpu_layers: int | None, n_ctx: int,
              filename, kv_cache_tokens, progress=None, weight_cache=None, **engine_opts) -> "Session":
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 2:
            raise InvalidRequestError(f"n_ctx must be an int >= 2, got {n_ctx!r}")
        if device is not None and backend != "cpu":
            raise InvalidRequestError(f"pass backend= or device=, not both (got {backend!r} and {device!r})")
        if device is None and n_gpu_layers is not None:
            raise InvalidRequestError("n_gpu_layers needs device='cuda' or 'auto'")
        backends = ({backend: get_backend(backend)} if device is None
                    else open_device(device, n_gpu_layers, get_backend))
        m = load_model(resolve_model(model, filename=filename, progress=progress or log_progress(log)))
        try:  # the layers over the backends, once their count is known
            placement = offload(backends, m.config.n_layer, n_gpu_layers)
            n_ctx = min(n_ctx, m.config.n_ctx_train)
            m.set_context(n_ctx)
            if not m.causal:  # an encoder runs each input in one step: a whole context must fit one
                engine_opts["max_batch_tokens"] = max(engine_opts["max_batch_tokens"], n_ctx)
            kv_tokens = kv_cache_tokens or 4 * n_ctx
            wdir = cache_dir(weight_cache)
            engine = Engine(m, placement, n_ctx=n_ctx, kv_blocks=math.ceil(kv_tokens / 16),
                            weight_cache=WeightCache(wdir, m.file.identity()) if wdir else None, **engine_opts)
        except BaseException:
            m.close()
            raise
        engine.start()
        return cls(m, engine)

    async def aclose(self, *, abort: bool = True) -> None:
        """Stop the engine: in-flight requests are aborted (abort=True) or run to the end."""
        if self._closed:
            return
        self._closed = True
        await anyio.to_thread.run_sync(lambda: self.engine.close(abort=abort))
        self.model.close()

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

    async def _prompt_ids_off_loop(self, prompt, messages, tools: ToolPlan | None = None) -> list[int]:
        """Chat templates (their rendering time is the file's, not ours) and long prompts are
        prepared in a worker thread, so the application's event loop keeps running."""
        big = messages is not None or (isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS) or \
            (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > OFF_LOOP_CHARS)
        if big:
            return await anyio.to_thread.run_sync(self._prompt_ids, prompt, messages, tools)
        return self._prompt_ids(prompt, messages, tools)

    def _prompt_ids(self, prompt, messages, tools: ToolPlan | None = None) -> list[int]:
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
            return encode_chat(tok, self.model.chat_template, messages, limits=self.template_limits,
                               max_chars=max_chars, **extra)
        if isinstance(prompt, str):
            if len(prompt) > max_chars:
                raise ContextLengthError(f"the prompt has {len(prompt)} characters: more than a context of "
                                         f"{self.n_ctx} tokens can take")
            return tok.encode(prompt, add_special=True, parse_special=True)
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
        out = await self._pooled([await self._input_ids(t, truncate) for t in texts], pooling)
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
            raise InvalidRequestError("this model has no classification head (cls.output.weight): it does not rerank")
        ids = [await self._input_ids(self.rerank_ids(query, d), truncate) for d in documents]
        if not self.model.causal:
            return [float(v[0]) for v in await self._pooled(ids, "rank")]
        # a decoder reranker (Qwen3-Reranker): its head's rows on the last token's normed state,
        # softmaxed; the score is the first label's probability ("yes"), as llama.cpp has it
        logits = (await self._pooled(ids, "last")).astype(np.float64) @ self._rank_head().T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return [float(x) for x in p[:, 0] / p.sum(axis=1)]

    def has_rank_head(self) -> bool:
        return "cls.output.weight" in self.model.weights

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
        return ([tok.bos_id] if tok.add_bos else []) + q + ([eos] if tok.add_eos else []) \
            + ([tok.sep_id] if tok.kind == "wpm" else []) + d + ([eos] if tok.add_eos else [])

    async def _input_ids(self, text, truncate: bool) -> list[int]:
        ids = await self._prompt_ids_off_loop(text, None)
        limit = self.n_ctx if not self.model.causal else self.n_ctx - 1
        if truncate and len(ids) > limit:
            sep = self.model.tokenizer.kind == "wpm" and ids[-1] == self.model.tokenizer.sep_id
            ids = ids[:limit - 1] + [ids[-1]] if sep else ids[:limit]
        return ids

    async def _pooled(self, ids: list[list[int]], pooling: str) -> np.ndarray:
        """Run each input as a pooling request; (len(ids), width) float32 in their order."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        chan = Channel(loop_waker())
        reqs = [Request(prompt=p, params=SamplingParams(), max_tokens=0, on_token=_no_token, pooling=pooling,
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
        """Generate a completion. Arguments as `stream`."""
        text, ids, lps, reason, n_prompt, calls = [], [], [], "length", 0, None
        async for c in self._stream(prompt, **kwargs):
            if isinstance(c, int):
                n_prompt = c
                continue
            text.append(c.text)
            ids.extend(c.token_ids)
            if c.top_logprobs:
                lps.extend(c.top_logprobs)
            reason = c.finish_reason or reason
            calls = c.tool_calls or calls
        return Completion("".join(text), ids, reason, n_prompt, lps or None, tool_calls=calls)

    async def stream(self, prompt: str | Sequence[int] | None = None, **kwargs) -> AsyncIterator[Chunk]:
        """Yield Chunks as tokens come. Keyword arguments: messages, max_tokens, temperature,
        top_k, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty, seed,
        stop (strings), stop_token_ids, top_logprobs, timeout; response_format (OpenAI's
        json_object / json_schema, or {"type": "regex", "pattern"} / {"type": "grammar",
        "grammar": Lark}); tools and tool_choice (OpenAI's shapes; with messages=): the calls
        come in the last chunk, whose finish_reason is then "tool_calls"."""
        async for c in self._stream(prompt, **kwargs):
            if not isinstance(c, int):
                yield c

    async def _stream(self, prompt, *, messages=None, max_tokens: int | None = None,
                      stop: str | Sequence[str] | None = None, timeout: float | None = None,
                      response_format: dict | None = None, tools: list[dict] | None = None,
                      tool_choice: str | dict | None = None, **sampling) -> AsyncIterator[Chunk | int]:
        if self._closed:
            raise SessionClosedError("the session is closed")
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise InvalidRequestError(str(e)) from e
        max_tokens, stops, timeout = _check_limits(max_tokens, stop, timeout)
        grammar = constraint.grammar_from_response_format(response_format) if response_format is not None else None
        plan = ToolPlan.make(self.model, tools, tool_choice)
        if plan is not None:
            if messages is None:
                raise InvalidRequestError("tools need messages=, not a prompt")
            forced = plan.grammar(self.model.tokenizer)
            if forced is not None and grammar is not None:
                raise InvalidRequestError("pass response_format or a forced tool_choice, not both")
            grammar = (constraint.lark_grammar(forced), "tool-call grammar") if forced is not None else grammar
        ids = await self._prompt_ids_off_loop(prompt, messages, plan)
        # compiled against the vocabulary off the event loop (the first one builds the vocabulary)
        matcher = await anyio.to_thread.run_sync(self._matcher, grammar) if grammar is not None else None
        chan = Channel(loop_waker())
        req = Request(prompt=ids, params=params, matcher=matcher,
                      max_tokens=max_tokens if max_tokens is not None else max(self.n_ctx - len(ids), 0),
                      on_token=lambda t, lp: chan.put((t, lp)),
                      on_finish=lambda reason, err: chan.put((reason, err)))
        deadline = anyio.current_time() + timeout if timeout is not None else math.inf
        self.engine.submit(req)
        yield len(ids)
        decoder = StreamDecoder(self.model.tokenizer, prompt_ids=ids)
        calls = ToolOutput(plan) if plan is not None else None
        # held: text that may be the start of a stop string; recent: the text emitted last, as
        # much as a stop string could reach back into (the whole text made the matching quadratic)
        recent, held, keep = "", "", max(map(len, stops), default=0)
        done = False
        try:
            while not done:
                items = None
                with anyio.move_on_after(deadline - anyio.current_time()):  # no yield inside
                    items = await chan.get_all()
                if items is None:
                    raise RequestTimeoutError(f"the request did not finish within {timeout} s")
                toks, lps, new, reason = [], [], "", None
                for a, b in items:
                    if isinstance(a, str):  # finished
                        if b is not None:
                            raise b
                        if a == "closed":
                            raise SessionClosedError("the session was closed while the request ran")
                        reason, done = a, True
                        # a character cut short by max_tokens is dropped, not shown as U+FFFD
                        tail = decoder.flush()
                        piece, held, hit = _cut_at_stop(recent + new, held + tail.rstrip("\ufffd"),
                                                        stops, final=True)
                        new += piece
                        reason = "stop" if hit else reason
                        break
                    # one token at a time: a stop string ends the tokens as well as the text
                    toks.append(a)
                    if b is not None:
                        lps.append(b)
                    piece, held, hit = _cut_at_stop(recent + new, held + decoder.push(a), stops, final=False)
                    new += piece
                    if hit:
                        reason, done = "stop", True
                        self.engine.abort(req.id)  # the engine may still be running it
                        break
                recent = (recent + new)[-keep:] if keep else ""
                if toks or new or done:
                    c = Chunk(new, toks, reason, lps or None, prompt_tokens=len(ids) if done else None)
                    yield calls.feed(c) if calls is not None else c
        finally:
            if not done:
                self.engine.abort(req.id)


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


def _cut_at_stop(before: str, new: str, stops: list[str], *, final: bool) -> tuple[str, str, bool]:
    """Split `new` into (emit, hold, hit): cut at the first stop string (searching across
    the boundary with `before`), and hold back a tail that could begin a stop string."""
    if not stops:
        return new, "", False
    window = max(len(s) for s in stops) - 1
    joined = before[-window:] + new if window else new
    offset = len(joined) - len(new)
    cut = min((i for i in (joined.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return new[:max(cut - offset, 0)], "", True
    if final:
        return new, "", False
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(new)), 0, -1):
            if new.endswith(s[:k]):
                hold = max(hold, k)
                break
    return new[:len(new) - hold], new[len(new) - hold:], False


def _no_token(tok: int, lp) -> None:  # embedding requests sample nothing
    raise AssertionError("an embedding request got a token")
