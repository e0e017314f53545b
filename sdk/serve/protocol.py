"""OpenAI request bodies (the fields hearthlm takes) and the response pieces built from a
Session's Completion and Chunks. Unknown fields are ignored, as OpenAI's SDKs add new ones."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hearthlm.runtime.errors import InvalidRequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None

    def session_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Session.stream/generate; None means the Session's default."""
        if self.n != 1:
            raise InvalidRequestError("n must be 1: one choice per request")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported")
        kw = dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                  stop=self.stop, frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty)
        return {k: v for k, v in kw.items() if v is not None}


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # passed through to Session.generate: the Session says whether it takes them
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def session_kwargs(self) -> dict[str, Any]:
        kw = super().session_kwargs()
        if self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        if self.logprobs:  # at least 1: the sampled token's logprob comes with the list
            kw["top_logprobs"] = max(self.top_logprobs or 0, 1)
        for k in ("response_format", "tools", "tool_choice"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        return kw


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None  # the legacy API: how many top logprobs per token
    echo: bool = False

    def prompt_arg(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise InvalidRequestError("one prompt per request (a list of one string, or a string)")
            p = p[0]
        if self.echo:
            raise InvalidRequestError("echo is not supported")
        return p

    def session_kwargs(self) -> dict[str, Any]:
        kw = super().session_kwargs()
        if self.logprobs is not None:
            kw["top_logprobs"] = max(self.logprobs, 1)
        return kw


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def texts(self) -> list[str] | list[list[int]]:
        if self.dimensions is not None:
            raise InvalidRequestError("dimensions is not supported: the model's own size is returned")
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(t, int) for t in x):
            return [x]  # one text as token ids
        if not x:
            raise InvalidRequestError("input is empty")
        return x


class RerankRequest(_Body):
    """llama-server's /rerank: Jina's and Cohere's shape (query, documents, top_n), or TEI's
    (query, texts, return_text), which is answered in TEI's shape."""
    model: str = ""
    query: str
    documents: list[str | dict] | None = None
    texts: list[str] | None = None
    top_n: int | None = None
    return_documents: bool = False
    return_text: bool = False

    def docs(self) -> list[str]:
        docs = self.documents if self.documents is not None else self.texts
        if not docs:
            raise InvalidRequestError("documents must be a non-empty list of strings")
        out = [d.get("text") if isinstance(d, dict) else d for d in docs]  # Cohere's {"text": ...} too
        if not all(isinstance(d, str) for d in out):
            raise InvalidRequestError("each document must be a string (or an object with a text string)")
        if self.top_n is not None and self.top_n < 1:
            raise InvalidRequestError("top_n must be at least 1")
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int) -> dict[str, int]:
    return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def logprob_entries(tokenizer, token_ids, tops, k: int) -> list[dict[str, Any]]:
    """Chat logprobs: per token its logprob and the k most likely alternatives."""
    out = []
    for tid, top in zip(token_ids, tops or []):
        d = dict(top)
        alts = [dict(_token(tokenizer, i), logprob=lp) for i, lp in top[:k]]
        out.append(dict(_token(tokenizer, tid), logprob=d.get(tid, float("-inf")), top_logprobs=alts))
    return out


def legacy_logprobs(tokenizer, token_ids, tops, k: int, offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
    tokens, lps, alts, offsets = [], [], [], []
    for tid, top in zip(token_ids, tops or []):
        t = _token(tokenizer, tid)["token"]
        tokens.append(t)
        lps.append(dict(top).get(tid, float("-inf")))
        alts.append({_token(tokenizer, i)["token"]: lp for i, lp in top[:k]})
        offsets.append(offset)
        offset += len(t)
    return dict(tokens=tokens, token_logprobs=lps, top_logprobs=alts, text_offset=offsets)


def _token(tokenizer, tid: int) -> dict[str, Any]:
    b = tokenizer.token_bytes(tid)
    return dict(token=b.decode("utf-8", errors="replace"), bytes=list(b))


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


def error_json(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": ErrorBody(message=message, type=kind, param=param, code=code).model_dump()}
