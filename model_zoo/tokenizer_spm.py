"""SentencePiece-style tokenizer (`tokenizer.ggml.model == 'llama'`) as llama.cpp runs it.

llama.cpp's `llm_tokenizer_spm` is not SentencePiece's unigram Viterbi: it starts from
single characters and keeps merging the adjacent pair whose concatenation is the vocab
token of highest score (leftmost on ties); characters left unmerged and not in the vocab
fall back to `<0xXX>` byte tokens. Neither `tokenizers` model reproduces that exactly, so it
is written out here (a heap of candidate pairs over a linked list of symbols).
"""

from __future__ import annotations

import heapq


def spm_encode(text: str, token_to_id: dict[str, int], scores: list[float],
               byte_ids: list[int | None]) -> list[int]:
    """Token ids of `text` (spaces already escaped to U+2581 by the caller)."""
    if not text:
        return []
    sym = list(text)                      # symbol text; "" once merged into its left neighbour
    n = len(sym)
    nxt = list(range(1, n)) + [-1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, str]] = []
    get = token_to_id.get

    def push(left: int, right: int) -> None:
        merged = sym[left] + sym[right]
        tid = get(merged)
        if tid is not None:
            # max score first, then the leftmost pair; `merged` detects stale entries.
            heapq.heappush(heap, (-scores[tid], left, right, merged))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        # Skip a pair one of whose symbols has changed since it was queued.
        if not sym[left] or not sym[right] or nxt[left] != right or sym[left] + sym[right] != merged:
            continue
        sym[left] = merged
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        if prv[left] >= 0:
            push(prv[left], left)
        if nxt[left] >= 0:
            push(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        s = sym[i]
        tid = get(s)
        if tid is not None:
            out.append(tid)
        else:
            # Only single characters can be left outside the vocab: spell them as bytes.
            for b in s.encode("utf-8"):
                bid = byte_ids[b]
                if bid is not None:
                    out.append(bid)
        i = nxt[i]
    return out
