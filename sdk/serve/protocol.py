"""OpenAI request bodies (the fields hearthlm takes) and the response pieces built from a
Session's Completion and Chunks. Unknown fields are ignored, as OpenAI's SDKs add new ones."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hearthlm.core.errors import InvalidRequestError


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
    # OpenAI's {token id: bias}; llama-server's string keys (each token of the string) and
    # [[token or string, bias], ...]; a bias of false bans the token
    logit_bias: dict[str, float | bool] | list[list[Any]] | None = None
    # beyond OpenAI, as vLLM and llama-server take them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None  # llama-server's name
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    speculative: str | None = None  # "ngram": prompt lookup; "draft": the server's draft model (its default); "off"
    # llama-server's per-request LoRA: [{"id": index in the server's --lora list, or "name": ..., "scale": ...}]
    lora: list[dict[str, Any]] | None = None

    def adapter_kwargs(self, adapters: list[str], named: str | None = None) -> dict[str, Any]:
        """Session.generate's `adapters` from the `lora` field (ids index `adapters`, the session's in
        load order) and the adapter the model name chose (scale 1 unless the field gives another)."""
        out = {named: 1.0} if named else {}
        for e in self.lora or ():
            if not isinstance(e, dict) or ("id" in e) == ("name" in e):
                raise InvalidRequestError('each lora entry must be {"id": N, "scale": S} or {"name": ..., "scale": S}')
            name = e.get("name")
            if "id" in e:
                i = e["id"]
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(adapters):
                    raise InvalidRequestError(f"lora id {i!r} is not one of the {len(adapters)} adapters loaded")
                name = adapters[i]
            scale = e.get("scale", 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise InvalidRequestError(f"lora {name!r}: scale must be a number, got {scale!r}")
            out[name] = float(scale)
        return {"adapters": out} if out else {}

    def session_kwargs(self, tokenizer=None) -> dict[str, Any]:
        """Keyword arguments for Session.stream/generate; None means the Session's default."""
        kw = dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                  stop=self.stop, frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                  top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                  speculative=self.speculative, repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None
                  else self.repeat_penalty)
        if self.logit_bias:
            kw["logit_bias"] = logit_bias(self.logit_bias, tokenizer)
        if self.n != 1:
            kw["n"] = self.n
        return {k: v for k, v in kw.items() if v is not None}


def logit_bias(spec, tokenizer) -> dict[int, float]:
    """{token id: bias} from OpenAI's map (ids as strings) or llama-server's forms."""
    pairs = spec.items() if isinstance(spec, dict) else spec
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidRequestError("logit_bias entries must be [token, bias] pairs")
        key, bias = pair
        if bias is False:
            bias = float("-inf")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequestError(f"logit_bias: the bias of {key!r} must be a number or false")
        if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
            ids = [int(key)]
        elif isinstance(key, str) and key and tokenizer is not None:
            ids = tokenizer.encode(key)
        else:
            raise InvalidRequestError(f"logit_bias: {key!r} is neither a token id nor a string")
        for t in ids:
            if t < 0:
                raise InvalidRequestError(f"logit_bias: token id {t} is negative")
            out[t] = float(bias)
    return out


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # passed through to Session.generate: the Session says whether it takes them
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and llama-server's name
    reasoning_budget: int | None = None  # tokens of thinking, then it is closed and the answer begins
    reasoning_format: str | None = None  # llama-server's: "none" leaves the thinking in the content

    def session_kwargs(self, tokenizer=None) -> dict[str, Any]:
        kw = super().session_kwargs(tokenizer)
        if self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        if self.logprobs:  # at least 1: the sampled token's logprob comes with the list
            kw["top_logprobs"] = max(self.top_logprobs or 0, 1)
        for k in ("response_format", "tools", "tool_choice", "chat_template_kwargs", "reasoning_budget"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        if self.reasoning_format is not None:
            kw["reasoning_format"] = "none" if self.reasoning_format == "none" else "auto"
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
        return p

    def session_kwargs(self, tokenizer=None) -> dict[str, Any]:
        kw = super().session_kwargs(tokenizer)
        if self.logprobs is not None:
            kw["top_logprobs"] = max(self.logprobs, 1)
            if self.echo:  # the prompt's tokens with theirs, first (lm-evaluation-harness's loglikelihood)
                kw["prompt_logprobs"] = self.logprobs
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo and logprobs: scoring the prompt)")
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


def echo_logprobs(tokenizer, prompt_lps, k: int) -> dict[str, Any]:
    """Legacy logprobs of the prompt's tokens (echo): the first one's are null, as OpenAI has it."""
    tokens, lps, alts, offsets, offset = [], [], [], [], 0
    for tid, lp, top in prompt_lps:
        t = _token(tokenizer, tid)["token"]
        tokens.append(t)
        lps.append(lp)
        alts.append(None if lp is None else {_token(tokenizer, i)["token"]: v for i, v in (top or [])[:k]})
        offsets.append(offset)
        offset += len(t)
    return dict(tokens=tokens, token_logprobs=lps, top_logprobs=alts, text_offset=offsets)


def join_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """b's lists after a's, b's text offsets moved past a's text."""
    end = a["text_offset"][-1] + len(a["tokens"][-1]) if a["tokens"] else 0
    return dict(tokens=a["tokens"] + b["tokens"], token_logprobs=a["token_logprobs"] + b["token_logprobs"],
                top_logprobs=a["top_logprobs"] + b["top_logprobs"],
                text_offset=a["text_offset"] + [o + end for o in b["text_offset"]])


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
