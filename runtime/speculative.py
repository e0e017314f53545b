"""Prompt-lookup drafting (n-gram speculation, as llama.cpp's ngram drafts and vLLM's
prompt_lookup): the tokens that followed the latest earlier occurrence of the sequence's last
n tokens are proposed as its next ones; the engine computes them as extra query rows of the
sequence in one forward pass, keeps the prefix the target model agrees with (runtime.sampling
.verify) and rolls the KV of the rest back (their slots are simply overwritten later; a hybrid
model's recurrent state goes back to its snapshot after the last kept token: runtime.seq_memory).
Pays where outputs repeat their input: code edits, extraction, summaries, RAG answers."""
from __future__ import annotations

N_MAX, N_MIN = 3, 2  # n-gram sizes tried, longest first (single tokens match too often to pay)
K_MAX = 10           # draft tokens at most per step


class DraftLength:
    """A request's draft length, adapted step by step, and its counts (any drafter's)."""

    def __init__(self, k_max: int = K_MAX) -> None:
        self.k_max = k_max
        self.k = k_max  # this step's draft length: shrinks after rejections, grows after acceptances
        self.drafted = self.accepted = 0

    def feedback(self, n_drafted: int, n_accepted: int) -> None:
        """Adapt the draft length: all kept, try longer; a miss, a little past what was kept."""
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.k = min(self.k_max, self.k * 2) if n_accepted == n_drafted else max(2, n_accepted + 1)


class NgramDrafter(DraftLength):
    """Per request: an index of every n-gram of its tokens (prompt and output) to the position
    after its latest occurrence, kept up to date as tokens come (O(1) per token)."""

    def __init__(self, k_max: int = K_MAX) -> None:
        super().__init__(k_max)
        self._index: dict[tuple[int, ...], int] = {}
        self._upto = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to try after `tokens`."""
        n_tok = len(tokens)
        for e in range(max(self._upto, N_MIN), n_tok):  # n-grams ending at e (exclusive), e < n_tok
            for n in range(N_MIN, min(N_MAX, e) + 1):
                self._index[tuple(tokens[e - n:e])] = e
        self._upto = max(self._upto, n_tok)
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        for n in range(min(N_MAX, n_tok), N_MIN - 1, -1):
            e = self._index.get(tuple(tokens[n_tok - n:]))
            if e is not None:  # up to an image's placeholder ids (negative): never drafted
                d = tokens[e:e + limit]
                return next((d[:i] for i, t in enumerate(d) if t < 0), d)
        return []
