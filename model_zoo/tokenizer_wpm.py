"""BERT's WordPiece (`tokenizer.ggml.model == 'bert'`), as llama.cpp's llm_tokenizer_wpm runs it.

llama.cpp normalizes and splits the text itself (below: lowercase and strip accents unless the
GGUF says otherwise, drop control characters, split on whitespace, and make each punctuation
mark, ASCII symbol and CJK ideograph a word of its own), then matches each word greedily,
longest piece first, against a vocabulary whose word-initial pieces carry a leading U+2581
and whose continuations ("##ing" in BERT's vocab.txt) carry nothing; a word with an unmatched
rest becomes [UNK] whole. The matching is the `tokenizers` library's WordPiece on that vocab
rewritten back to BERT's spelling.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

_SPACE = "\u2581"
# llama.cpp's \s (unicode.cpp's whitespace set)
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                         0x2029, 0x202F, 0x205F, 0x3000])
_CONTROL = frozenset(("Cc", "Cf", "Co", "Cs"))  # \p{C} as llama.cpp's tables have it (unassigned is not)
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


@lru_cache(maxsize=65536)
def _char(c: str, lowercase: bool, strip_accents: bool) -> tuple[str, int]:
    """(its text after normalization, kind): kind 0 drop, 1 whitespace, 2 a word by itself, 3 part of a word."""
    if strip_accents:  # llama.cpp's NFD table keeps the first code point of the decomposition
        c = unicodedata.normalize("NFD", c)[0]
    cp = ord(c)
    if cp in _WHITESPACE:
        return "", 1
    cat = unicodedata.category(c)
    if cp == 0 or cp == 0xFFFD or cat in _CONTROL or (strip_accents and cat[0] == "M"):
        return "", 0
    if lowercase:
        c = c.lower()[0]
    alone = cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or any(lo <= cp <= hi for lo, hi in _CJK)
    return c, 2 if alone else 3


def split_words(text: str, *, lowercase: bool = True, strip_accents: bool = True) -> list[str]:
    """llm_tokenizer_wpm_session::preprocess."""
    words: list[str] = []
    cur: list[str] = []
    for ch in text:
        s, kind = _char(ch, lowercase, strip_accents)
        if kind == 3:
            cur.append(s)
            continue
        if cur and kind:
            words.append("".join(cur))
            cur = []
        if kind == 2:
            words.append(s)
    if cur:
        words.append("".join(cur))
    return words


def build_wpm(tokens: list[str], unk_id: int | None) -> HFTokenizer:
    """WordPiece over the GGUF vocabulary: "\u2581word" -> "word", a continuation "ing" -> "##ing"."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t[1:] if t.startswith(_SPACE) else "##" + t, i)
    unk = "[UNK]"
    if unk_id is not None:
        unk = next(k for k, v in vocab.items() if v == unk_id)
    elif unk not in vocab:
        vocab[unk] = 0  # llama.cpp would push LLAMA_TOKEN_NULL; a vocab without [UNK] is broken anyway
    return HFTokenizer(models.WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##",
                                        max_input_chars_per_word=1 << 30))


def wpm_encode(tok: HFTokenizer, text: str, *, lowercase: bool, strip_accents: bool) -> list[int]:
    words = split_words(text, lowercase=lowercase, strip_accents=strip_accents)
    return tok.encode(words, is_pretokenized=True, add_special_tokens=False).ids if words else []
