"""SentencePiece-style tokenizer (`tokenizer.ggml.model == 'llama'`) as llama.cpp runs it.

llama.cpp's `llm_tokenizer_spm` is not SentencePiece's unigram Viterbi: it starts from
single characters and keeps merging the adjacent pair whose concatenation is the vocab
token of highest score (leftmost on ties); characters left unmerged and not in the vocab
fall back to `<0xXX>` byte tokens. Neither `tokenizers` model reproduces that exactly, so it
is written out here (a heap of candidate pairs over a linked list of symbols).

A heap entry is one int, (score rank << bits) | left symbol: the pair is whatever follows
`left` when it pops, and stands if its text is still a token of that rank. Tuples of score,
indices and text cost ~170 bytes a character and twice the time (a hostile 4 M-character
prompt, which a 128k context admits, took 0.7 GB).
"""

from __future__ import annotations

import heapq
from array import array

import numpy as np


def score_ranks(scores: list[float]) -> array:
    """Each token's score as a dense rank, best first: equal scores share one (the merge order
    then falls to the leftmost pair, as llama.cpp's); a NaN score ranks last. An int64 array:
    8 bytes a token (Gemma's vocab has 262k)."""
    _, inverse = np.unique(-np.asarray(scores, dtype=np.float64), return_inverse=True)
    return array("q", inverse.astype(np.int64).tobytes())


def spm_encode(text: str, token_to_id: dict[str, int], ranks: array,
               byte_ids: list[int | None]) -> list[int]:
    """Token ids of `text` (spaces already escaped to U+2581 by the caller); `ranks` from
    score_ranks."""
    if not text:
        return []
    sym = list(text)                      # symbol text; "" once merged into its left neighbour
    n = len(sym)
    nxt = array("q", range(1, n + 1))
    nxt[n - 1] = -1
    prv = array("q", range(-1, n - 1))
    get = token_to_id.get
    bits = n.bit_length()
    mask = (1 << bits) - 1
    heap = []
    for i in range(n - 1):
        tid = get(sym[i] + sym[i + 1])
        if tid is not None:
            heap.append((ranks[tid] << bits) | i)
    heapq.heapify(heap)

    def push(left: int) -> None:
        tid = get(sym[left] + sym[nxt[left]])
        if tid is not None:
            heapq.heappush(heap, (ranks[tid] << bits) | left)

    while heap:
        key = heapq.heappop(heap)
        left = key & mask
        right = nxt[left]
        if right < 0 or not sym[left]:
            continue
        merged = sym[left] + sym[right]
        tid = get(merged)
        if tid is None or ranks[tid] != key >> bits:  # a pair that changed since it was queued
            continue
        sym[left] = merged
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        if prv[left] >= 0:
            push(prv[left])
        if nxt[left] >= 0:
            push(left)

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
