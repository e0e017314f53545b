"""A blocking wrapper for callers without an event loop: the Session runs on an event loop
in a background thread (anyio's blocking portal).

    with SyncSession("smollm2-135m-instruct") as s:
        print(s.generate("Hello", max_tokens=8).text)
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import anyio.from_thread

from hearthlm.model_zoo.resolve import DEFAULT_MODEL
from hearthlm.options import SessionOptions, takes_options
from hearthlm.session import Session
from hearthlm.types import Chunk, Completion


class SyncSession:
    @takes_options
    def __init__(self, model: str = DEFAULT_MODEL, *, options: SessionOptions | None = None,
                 **open_kwargs: Any) -> None:
        """Session.open(model, options=options, **open_kwargs), entered on a portal's thread."""
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:  # any failure here (a bad option, a missing file) must stop the portal's thread
            self._cm = Session.open(model, options=options, **open_kwargs)
            self.session: Session = self._portal.call(self._cm.__aenter__)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None
            raise

    def generate(self, prompt=None, **kwargs: Any) -> Completion:
        return self._portal.call(partial(self.session.generate, prompt, **kwargs))

    def generate_n(self, prompt=None, *, n: int, **kwargs: Any) -> list[Completion]:
        return self._portal.call(partial(self.session.generate_n, prompt, n=n, **kwargs))

    def act(self, **kwargs: Any) -> Completion:
        """Session.act (callables as tools; sync ones run in the portal's worker threads)."""
        return self._portal.call(partial(self.session.act, **kwargs))

    def score(self, prompt):
        return self._portal.call(self.session.score, prompt)

    def stream(self, prompt=None, **kwargs: Any) -> Iterator[Chunk]:
        """Chunks as they come; leaving the loop early aborts the request."""
        agen = self.session.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    yield self._portal.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(agen.aclose)

    def embed(self, texts, **kwargs: Any):
        return self._portal.call(partial(self.session.embed, texts, **kwargs))

    def rerank(self, query: str, documents, **kwargs: Any) -> list[float]:
        return self._portal.call(partial(self.session.rerank, query, documents, **kwargs))

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return self.session.tokenize(text, add_special)

    def detokenize(self, ids) -> str:
        return self.session.detokenize(ids)

    def stats(self) -> dict[str, Any]:
        return self.session.stats()

    def health(self) -> dict[str, Any]:
        return self.session.health()

    def close(self) -> None:
        if self._portal_cm is None:
            return
        try:
            self._portal.call(self._cm.__aexit__, None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None

    def __enter__(self) -> "SyncSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
