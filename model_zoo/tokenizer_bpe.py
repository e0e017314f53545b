"""Byte-level BPE (`tokenizer.ggml.model == 'gpt2'`) on the `tokenizers` library.

llama.cpp picks its pre-tokenizer regexes by `tokenizer.ggml.pre` (src/llama-vocab.cpp,
`llm_tokenizer_bpe`); each regex of a list splits the pieces the previous one left, and
text no regex matches stays a piece of its own: `Split(..., "isolated")` does exactly that.
"""

from __future__ import annotations

import re

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hearthlm.core.errors import ModelLoadError, UnsupportedModelError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's case-insensitive contractions, spelled out as it does (no inline (?i:)).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: QWEN2's with combining marks (\p{M}) kept inside words
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class _Pre:
    """One llama.cpp pre-tokenizer type: its regexes and the flags it sets."""

    def __init__(self, regexes, *, clean_spaces=True, ignore_merges=False, add_bos=False, add_sep=False):
        self.regexes = regexes          # applied in order, each splitting the last's pieces
        self.clean_spaces = clean_spaces  # llama_detokenize's " ," / " 's" clean-up
        self.ignore_merges = ignore_merges  # a whole word found in the vocab skips merging
        self.add_bos = add_bos          # default when tokenizer.ggml.add_bos_token is absent
        self.add_sep = add_sep          # a rerank pair's [SEP] between query and document (RoBERTa-style)


# GPT-4o's (o200k: gpt-oss, Llama 4) as llama.cpp writes it, its cased classes spelled by lookaheads
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + r"?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + r"?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken's (Mistral NeMo, Ministral 3): GPT-4o's letters without the contractions, one digit a piece
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_DEFAULT = _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
_STARCODER = [r"\p{N}", _GPT2]
_LLAMA3_PRE = _Pre([_LLAMA3], ignore_merges=True, add_bos=True)

# tokenizer.ggml.pre -> pre-tokenizer, as llama_vocab::impl::load maps them.
PRE_TYPES: dict[str, _Pre] = {
    "default": _DEFAULT,
    "": _DEFAULT,  # llama.cpp warns and degrades to 'default'
    **{k: _LLAMA3_PRE for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2")},
    **{k: _Pre([_LLAMA3]) for k in ("dbrx", "smaug-bpe")},
    **{k: _Pre([_GPT2]) for k in ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de",
                                  "jina-v2-es", "jina-v2-de", "mpt", "olmo", "jais",
                                  "gigachat", "exaone4", "mellum", "modern-bert")},
    # jina-reranker-v1-tiny/turbo-en (jina-bert-v2) and the like: GPT-2's split, a [SEP] in rerank pairs
    **{k: _Pre([_GPT2], add_sep=True) for k in ("jina-v1-en", "jina-v2-code", "roberta-bpe")},
    **{k: _Pre([_QWEN2], clean_spaces=False) for k in ("qwen2", "deepseek-r1-qwen", "kormo")},
    "qwen35": _Pre([_QWEN35], clean_spaces=False),
    **{k: _Pre([_QWEN2]) for k in ("stablelm2", "megrez")},
    **{k: _Pre(_STARCODER) for k in ("starcoder", "refact", "codeshell", "exaone",
                                     "minerva-7b", "mellum2")},
    **{k: _Pre(_STARCODER, clean_spaces=False) for k in ("smollm", "command-r")},
    **{k: _Pre([_GPT4O], clean_spaces=False) for k in ("gpt-4o", "llama4", "kanana2", "talkie")},
    "tekken": _Pre([_TEKKEN], clean_spaces=False, ignore_merges=True, add_bos=True),
    "falcon": _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
}


def pre_type(pre: str) -> _Pre:
    try:
        return PRE_TYPES[pre]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 (byte-level BPE) tokenizer; "
            f"supported: {sorted(k for k in PRE_TYPES if k)}") from None


def build_bpe(tokens: list[str], merges, pre: _Pre) -> HFTokenizer:
    """A `tokenizers` BPE over the GGUF vocab; it encodes text fragments free of specials."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merge_pairs(merges, vocab)
    # ignore_merges needs tokenizers >= 0.19; only llama3-style vocabs ask for it.
    extra = {"ignore_merges": True} if pre.ignore_merges else {}
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, **extra))
    except Exception as e:  # e.g. a merge whose parts are not in the vocab
        raise ModelLoadError(f"cannot build the BPE tokenizer from GGUF metadata: {e}") from e
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _merge_pairs(merges, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) pairs, each checked to make a token of the vocab."""
    pairs = []
    for m in merges:
        # llama.cpp splits at the first space after position 0, so a merge may start with one.
        pos = m.find(" ", 1)
        if pos < 0:
            raise ModelLoadError(f"malformed BPE merge {m!r} in tokenizer.ggml.merges")
        if m[:pos] + m[pos + 1:] not in vocab:  # `tokenizers` would panic (a BaseException), not raise
            raise ModelLoadError(f"BPE merge {m!r} in tokenizer.ggml.merges makes "
                                 f"{m[:pos] + m[pos + 1:]!r}, which is not in the vocab")
        pairs.append((m[:pos], m[pos + 1:]))
    return pairs


_WORDS = re.compile(r"[^\n]+|\n+")  # llama.cpp's split for SPM-style BPE: newlines apart, nothing else


def build_spm_bpe(tokens: list[str], merges) -> HFTokenizer:
    """Gemma 4's SPM-style BPE (tokenizer.ggml.model "gemma4"): merges over the raw UTF-8 text with
    spaces escaped as U+2581, no byte-level mapping; a character the vocab lacks becomes its UTF-8
    bytes' <0xXX> tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merge_pairs(merges, vocab)
    try:
        return HFTokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True))
    except Exception as e:
        raise ModelLoadError(f"cannot build the BPE tokenizer from GGUF metadata: {e}") from e


def spm_bpe_encode(tok: HFTokenizer, text: str, vocab: dict[str, int]) -> list[int]:
    """Ids of one fragment of text (spaces already escaped), word by word as llama.cpp splits it;
    a run of newlines that is itself a token is that token (llama.cpp's fix for Gemma 4)."""
    words = _WORDS.findall(text)
    out: list[int] = []
    for w in words:
        if w[0] == "\n" and w in vocab:
            out.append(vocab[w])
        else:
            out.extend(tok.encode(w, add_special_tokens=False).ids)
    return out


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable code point table (bytes_to_unicode).
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def bpe_piece_bytes(text: str) -> bytes:
    """A normal byte-level token's text back to its bytes (llama_decode_text)."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        # A code point outside the byte table: llama.cpp prints an [UNK_BYTE_..] marker;
        # its own UTF-8 is the more useful rendering.
        return b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE
                        else c.encode("utf-8") for c in text)
