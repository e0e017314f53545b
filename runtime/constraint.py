"""Constrained decoding with llguidance: a per-request matcher over the model's vocabulary.
The engine computes each step's token masks in a worker thread while the forward pass runs
(`MaskWorker`), then applies a request's mask to its logits row before sampling.

llguidance is an optional dependency (`pip install 'hearthlm[structured]'`): this module
imports without it, and asking for a constraint then fails with an InvalidRequestError."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import numpy as np

from hearthlm.core.errors import HearthError, InvalidRequestError

try:
    import llguidance as llg
    import llguidance.numpy as llg_np
except ImportError:  # the core runs without it
    llg = llg_np = None

INSTALL_HINT = "structured output needs llguidance: pip install 'hearthlm[structured]'"
# compact JSON ("a": 1, "b": 2): flexible whitespace lets small models loop on newlines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(HearthError):
    """The grammar rejected the generation mid-way (or ran past its limits): that request ends."""


def available() -> bool:
    return llg is not None


class Vocabulary:
    """The model's vocabulary as llguidance sees it, built once per model (about a second)."""

    def __init__(self, tokens: list[bytes], eos_ids: Iterable[int], encode: Callable[[str], list[int]],
                 n_vocab: int) -> None:
        """`tokens`: the byte string of every id, specials prefixed with 0xFF; `encode`: text ->
        ids as a continuation; `n_vocab`: logits width (ids past `tokens` are never allowed)."""
        if llg is None:
            raise InvalidRequestError(INSTALL_HINT)
        eos = sorted(eos_ids)

        class _Source:  # the shape llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = eos[0], None
            special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == b"\xff"]

            def __call__(self, text):
                if not isinstance(text, str):
                    raise TypeError("str only")  # the wrapper then passes str
                return encode(text)
        _Source.tokens = tokens
        self.n_vocab = n_vocab
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Source()), n_vocab=n_vocab, eos_token=eos)


def grammar_from_response_format(rf: Any) -> tuple[str, str]:
    """(llguidance grammar, what it was) for an OpenAI-shaped response_format (json_object,
    json_schema), or regex / grammar (Lark). Shape errors raise InvalidRequestError; the
    grammar itself is checked by `Matcher`."""
    if llg is None:
        raise InvalidRequestError(INSTALL_HINT)
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequestError("response_format must be a dict with a 'type' (json_object, json_schema, "
                                  "regex or grammar)")
    kind = rf["type"]
    if kind == "text":
        raise InvalidRequestError("response_format type 'text' takes no grammar; leave response_format out")
    if kind == "json_object":
        return json_grammar({"type": "object"}), "JSON schema"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise InvalidRequestError("response_format json_schema must be {'name': ..., 'schema': {...}}")
        return json_grammar(js.get("schema", {})), "JSON schema"
    if kind == "regex":
        if not isinstance(rf.get("pattern"), str):
            raise InvalidRequestError("response_format regex needs a 'pattern' string")
        return llg.LLMatcher.grammar_from_regex(rf["pattern"]), "regex"
    if kind == "grammar":
        if not isinstance(rf.get("grammar"), str):
            raise InvalidRequestError("response_format grammar needs a 'grammar' string (Lark)")
        return llg.LLMatcher.grammar_from_lark(rf["grammar"]), "Lark grammar"
    raise InvalidRequestError(f"response_format type {kind!r} is not one of json_object, json_schema, "
                              "regex, grammar")


def json_grammar(schema: Any) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"invalid JSON schema: {e}") from e


def lark_grammar(text: str) -> str:
    if llg is None:
        raise InvalidRequestError(INSTALL_HINT)
    return llg.LLMatcher.grammar_from_lark(text)


class Matcher:
    """One request's grammar state: which tokens may come next; it consumes what was sampled."""

    def __init__(self, vocab: Vocabulary, grammar: str, what: str = "grammar") -> None:
        err = llg.LLMatcher.validate_grammar(grammar, vocab.lltok)
        if err:
            raise InvalidRequestError(f"invalid {what}: {err}")
        self.m = llg.LLMatcher(vocab.lltok, grammar, log_level=0)
        if self.m.is_error():
            raise InvalidRequestError(f"invalid {what}: {self.m.get_error()}")
        self.n_vocab = vocab.n_vocab

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise GrammarError(f"the grammar rejected token {token}: {self.m.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows no alternative to (`", "name": "`), consumed."""
        if limit <= 0 or self.m.is_stopped():
            return []
        ff = self.m.compute_ff_tokens()[:limit]
        if ff and not self.m.consume_tokens(ff):
            raise GrammarError(f"the grammar rejected its own forced tokens: {self.m.get_error()}")
        return ff

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens (a draft) the grammar would take in a row from here."""
        return self.m.validate_tokens(tokens) if tokens else 0

    @property
    def done(self) -> bool:
        """Complete: only end-of-generation may follow."""
        return self.m.is_stopped()

    def apply(self, logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """logits (n_vocab,) with the tokens not `allowed` (bool, n_vocab) at -inf."""
        if self.m.is_error():
            raise GrammarError(f"grammar error: {self.m.get_error()}")
        if not allowed.any():
            raise GrammarError("the grammar allows no token here")
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)


class MaskWorker:
    """Fills the next-token masks of a step's constrained rows in a worker thread, so that
    they are ready when the forward pass (which runs meanwhile) is."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab, self.words = n_vocab, (n_vocab + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hearthlm-mask")
        self._llexec = llg.LLExecutor()
        self.compute_s = 0.0  # worker time spent filling masks
        self.wait_s = 0.0     # engine time spent waiting for them after the forward pass
        self.n_masks = 0
        self._lock = threading.Lock()

    def start(self, matchers: list[Matcher], drafts: list[list[int]] | None = None) -> Future | None:
        if not matchers:
            return None
        return self._pool.submit(self._fill, matchers, drafts or [[] for _ in matchers])

    def _fill(self, matchers: list[Matcher], drafts: list[list[int]]) -> np.ndarray:
        """(rows, n_vocab) bool: the allowed tokens, unpacked here, off the engine's path; per
        matcher one row, and one more after each token of its draft (validated when drafted:
        taken on here and rolled back)."""
        t0 = time.perf_counter()
        at = np.cumsum([0] + [1 + len(d) for d in drafts])
        masks = np.zeros((at[-1], self.words), np.int32)
        llg_np.fill_next_token_bitmask_par(self._llexec, [(m.m, int(at[i])) for i, m in enumerate(matchers)], masks)
        for i, (m, d) in enumerate(zip(matchers, drafts)):
            for j, t in enumerate(d):
                m.m.consume_token(t)
                llg_np.fill_next_token_bitmask(m.m, masks, int(at[i]) + 1 + j)
            if d:
                m.m.rollback(len(d))
        masks = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little", count=self.n_vocab).view(bool)
        with self._lock:
            self.compute_s += time.perf_counter() - t0
            self.n_masks += len(masks)
        return masks

    def join(self, job: Future | None) -> np.ndarray | None:
        if job is None:
            return None
        t0 = time.perf_counter()
        try:
            return job.result()
        finally:
            self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
