"""Fuzz target: both tokenizers (byte-level BPE and SPM), on tiny vocabularies and on the real
models' when installed: encode of arbitrary text (lone surrogates, special-token texts and
their fragments, long runs), encode_parts of arbitrary parts, decode of arbitrary id lists
(out of range, negative, numpy ints), the streaming decoder and the per-token accessors.

Oracles beyond "a result or a HearthError": ids lie in the vocab; BPE tokens spell the text's
UTF-8 exactly; SPM text free of specials decodes back to itself; streaming equals decode.
"""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fuzz.engine import Draw
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.model_zoo.tokenizer import StreamDecoder, Tokenizer
from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode
from hearthlm.model_zoo.tokenizer_rules import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

NAME = "tokenizer"
MAX_LEN = 1024


def _metadata(seed: int) -> dict:
    from fuzz.gguf_target import seed_files
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.gguf"
        p.write_bytes(seed_files()[seed])
        with GGUFFile.open(p) as f:
            return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.ggml")}


def _with(md: dict, extra: dict[str, int]) -> dict:
    """md plus tokens {text: token type} at the end of the vocab."""
    md = dict(md)
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"]) + list(extra)
    md["tokenizer.ggml.token_type"] = np.concatenate([md["tokenizer.ggml.token_type"],
                                                      np.array(list(extra.values()), np.int32)])
    if "tokenizer.ggml.scores" in md:
        md["tokenizer.ggml.scores"] = np.concatenate([md["tokenizer.ggml.scores"], np.zeros(len(extra), np.float32)])
    return md


# control (3), user-defined (4), unused (5) tokens, and texts llama.cpp treats specially
_EXTRA = {"<|eot_id|>": 3, "<tool>": 4, "<|fim_prefix|>": 3, "[PAD]": 3, "<unused0>": 3, "ab": 4, "<x": 5}


@functools.lru_cache(maxsize=1)
def tokenizers() -> tuple[tuple[str, Tokenizer], ...]:
    bpe, spm = _metadata(0), _metadata(2)
    toks = [("bpe-gpt2", Tokenizer(bpe)),
            ("bpe-llama3", Tokenizer(_with(bpe, _EXTRA) | {"tokenizer.ggml.pre": "llama3"})),
            ("spm", Tokenizer(_with(spm, _EXTRA))),
            ("spm-noprefix", Tokenizer(spm | {"tokenizer.ggml.add_space_prefix": False,
                                              "tokenizer.ggml.add_eos_token": True}))]
    from hearthlm.model_zoo.resolve import resolve_model
    for alias in ("smollm2-135m-instruct", "gemma-3-270m"):
        try:
            with GGUFFile.open(resolve_model(alias, offline=True)) as f:
                toks.append((alias, Tokenizer(f.metadata)))
        except Exception:  # not installed here: the tiny vocabularies still run
            pass
    return tuple(toks)


_CHUNKS = ["hello", " world", "The", " ", "  ", "\n", "\r\n", "\t", "\u00a0", "\u3000", "123", "4567890",
           "'s", "'LL", " ,", " .", "!?", "...", "é", "中文", "🙂", "e\u0301", "שלום", "\u200b", "\ufeff",
           "\u2581", "\u2581\u2581", "\x00", "\x1b[0m", "\ud800", "\udfff", "\udc80x", "<", "|>", "<|im_",
           "\x00hearthlm-msg-0\x00", "<0x41>", "Ġt", " t", "th", "<s>", "</s>", "<unk>"]


def draw_text(d: Draw, tok: Tokenizer, max_chunks: int = 12) -> str:
    specials = [tok.token_text(i) for i in sorted(tok.eog_ids)] + [t for t in _EXTRA]
    out = []
    for _ in range(d.int(max_chunks + 1)):
        k = d.int(10)
        if k < 5:
            c = d.pick(_CHUNKS)
        elif k < 7:
            c = d.pick(specials)
            c = c[:d.int(len(c) + 1)] if d.int(4) == 0 else c  # sometimes only a prefix
        elif k == 7:
            c = d.bytes(d.int(16)).decode("utf-8", "surrogateescape")  # lone surrogates too
        elif k == 8:
            c = d.bytes(d.int(8)).decode("latin-1")
        else:
            c = chr(d.int(0x110000))
        out.append(c * d.pick([1, 1, 1, 2, 3, 64, 1000]))
    return "".join(out)[:20_000]  # long enough for any quadratic step to show


def draw_ids(d: Draw, tok: Tokenizer, valid_only: bool = False) -> list:
    n, ids = tok.vocab_size, []
    for _ in range(d.int(48)):
        k = d.int(4 if valid_only else 9)
        if k < 3:
            ids.append(d.int(n))
        elif k == 3:
            ids.append(d.pick(sorted(tok.eog_ids | {tok.bos_id or 0, tok.eos_id or 0, n - 1})))
        elif k < 6:
            ids.append(d.pick([-1, -2, n, n + 1, 2**31, -2**31, 2**63, 2**64, -10**30, True]))
        else:
            ids.append(d.pick([np.int64, np.uint32, np.int8, np.int16])(d.int(min(n, 127))))
    return ids


@functools.lru_cache(maxsize=None)
def _missing_bytes(tok: Tokenizer) -> frozenset[int]:
    """Bytes a byte-level vocab has no token for (SmolLM2 lacks 21, such as 0xF2)."""
    table = _byte_to_unicode()
    return frozenset(b for b in range(256) if tok.token_id(table[b]) is None)


@functools.lru_cache(maxsize=None)
def _unused_texts(tok: Tokenizer) -> tuple[str, ...]:
    """Texts of the tokens that render as nothing (unused or undefined types)."""
    return tuple(tok.token_text(i) for i in range(tok.vocab_size)
                 if not tok._attr[i] & (NORMAL | USER_DEFINED | BYTE | CONTROL | UNKNOWN))


def _has_special(tok: Tokenizer, text: str) -> bool:
    """Whether text holds a token text that the special split cuts out (small vocabs only)."""
    return any(t in text for t in _EXTRA) or any(
        tok.token_text(i) in text for i in range(tok.vocab_size) if tok.is_control(i))


def warm() -> None:
    """The tokenizers, real vocabularies included, loaded before the first input is measured."""
    for _, tok in tokenizers():
        _unused_texts(tok)


def case(data: bytes) -> tuple[str, Callable[[], None]]:
    """One input decoded: what it does (for a finding's report) and a thunk that does it, so
    that describing a hang does not run it again."""
    d = Draw(data)
    name, tok = d.pick(tokenizers())
    op = d.int(6)
    if op == 0:
        text, add, parse = draw_text(d, tok), d.bool(), d.bool()

        def run() -> None:
            ids = tok.encode(text, add_special=add, parse_special=parse)
            assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids), ids
            if tok.kind == "bpe" and not parse and not add and not any(t in text for t in _unused_texts(tok)):
                # bytes without a token drop, as in llama.cpp. (With ignore_merges, llama3-style, a
                # word that is an unused token's text becomes that token, which renders as nothing:
                # llama.cpp's llm_tokenizer_bpe and token_to_piece do the same.)
                want = bytes(b for b in text.encode() if b not in _missing_bytes(tok))
                assert b"".join(tok.token_bytes(i) for i in ids) == want, (name, text, ids)
            elif tok.kind == "spm" and not add and tok.vocab_size < 1000 and not _has_special(tok, text):
                assert tok.decode(ids) == text.replace("\u2581", " "), (name, text, ids)
        return f"{name}: encode({text!r}, add_special={add}, parse_special={parse})", run
    if op == 1:
        parts = [(draw_text(d, tok, 4), d.bool()) for _ in range(d.int(5))]
        if d.int(8) == 0:
            parts.append((d.pick([None, b"bytes", 7, ["x"]]), False))
        add = d.bool()

        def run() -> None:
            ids = tok.encode_parts(parts, add_special=add)
            assert all(0 <= i < tok.vocab_size for i in ids), ids
        return f"{name}: encode_parts({parts!r}, add_special={add})", run
    if op == 2:
        ids, skip = draw_ids(d, tok), d.bool()
        return f"{name}: decode({ids!r}, skip_special={skip})", \
            lambda: assert_type(tok.decode(ids, skip_special=skip), str)
    if op == 3:
        ids, skip = draw_ids(d, tok, valid_only=d.bool()), d.bool()
        prompt = draw_ids(d, tok, True) if d.bool() else None

        def run() -> None:
            dec = StreamDecoder(tok, prompt, skip_special=skip)
            assert_type("".join(dec.push(i) for i in ids) + dec.flush(), str)
            plain = StreamDecoder(tok)
            whole = "".join(plain.push(i) for i in ids) + plain.flush()
            if not tok.clean_spaces:  # decode's space clean-up is the one difference
                assert whole == tok.decode(ids), (name, ids, whole)
        return f"{name}: StreamDecoder(prompt_ids={prompt!r}, skip_special={skip}), push each of {ids!r}", run
    if op == 4:
        tid, text = (draw_ids(d, tok) or [0])[0], draw_text(d, tok, 2)

        def run() -> None:
            for f in (tok.token_to_piece, tok.token_bytes, tok.is_control, tok.is_eog, tok.token_text):
                f(tid)
            tok.token_id(text)
        return f"{name}: the accessors of id {tid!r}; token_id({text!r})", run
    text, skip = draw_text(d, tok), d.bool()
    return f"{name}: decode(encode({text!r}, add_special=True, parse_special=True), skip_special={skip})", \
        lambda: assert_type(tok.decode(tok.encode(text, add_special=True, parse_special=True), skip_special=skip), str)


def assert_type(x: object, t: type) -> None:
    assert isinstance(x, t), type(x)


def one_input(data: bytes) -> None:
    case(data)[1]()


def describe(data: bytes) -> str:
    what = case(data)[0]
    return what if len(what) < 8000 else what[:8000] + "..."


def seeds() -> list[bytes]:
    n = len(tokenizers())
    return [bytes([t, op]) + b"\x05\x01hello\x07\x00" for t in range(n) for op in range(6)]
