"""Tokenizers built from GGUF metadata, matching llama.cpp's `src/llama-vocab.cpp`.

Three vocab kinds: byte-level BPE (`gpt2`, on the `tokenizers` library, tokenizer_bpe.py),
SentencePiece-style (`llama`, llama.cpp's merge-by-score, tokenizer_spm.py) and BERT's
WordPiece (`bert`, tokenizer_wpm.py). This file holds
what they share, as llama.cpp does: token attributes, the special-token split that runs
before either, BOS/EOS, the end-of-generation set, and detokenization.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hearthlm.core.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

from .tokenizer_bpe import _byte_to_unicode, bpe_piece_bytes, build_bpe, build_spm_bpe, pre_type, spm_bpe_encode
from .tokenizer_rules import (
    AUTO_DETECT,
    BYTE,
    CONTROL,
    EOG_TEXTS,
    LSTRIP,
    NORMAL,
    RSTRIP,
    SPECIAL,
    TYPE_TO_ATTR,
    UNDEFINED,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    clean_spaces,
)
from .tokenizer_spm import score_ranks, spm_encode
from .tokenizer_wpm import build_wpm, wpm_encode

_SPACE = "\u2581"  # SentencePiece's escaped space
_HEX = frozenset("0123456789abcdefABCDEF")
_C_SPACE = " \t\n\v\f\r"  # C's isspace, as llama.cpp strips around LSTRIP / RSTRIP tokens


@contextmanager
def _key(name: str):
    """Metadata of the wrong type becomes a ModelLoadError naming its key."""
    try:
        yield
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int() of an infinite float
        raise ModelLoadError(f"GGUF metadata {name} has the wrong type: {e}") from e


def _ints(v: Any) -> list[int]:
    return v.tolist() if hasattr(v, "tolist") else [int(x) for x in v]


def _flag(md: Mapping[str, Any], key: str, default: bool) -> bool:
    """tokenizer.ggml.<key> when the file has it (llama.cpp's get_key), else the kind's default."""
    v = md.get(f"tokenizer.ggml.{key}")
    return default if v is None else bool(v)


def _text(t: Any) -> str:
    return t.decode("utf-8", "replace") if isinstance(t, (bytes, bytearray)) else str(t)


MEDIA = object()  # encode_parts: an image's place among the text parts
MEDIA_ID = -1     # ... and its id in the result

class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary (see module docstring)."""

    def __init__(self, md: Mapping[str, Any]):
        model = md.get("tokenizer.ggml.model")
        if model == "gpt2":
            self.kind = "bpe"
        elif model == "llama":
            self.kind = "spm"
        elif model == "bert":
            self.kind = "wpm"
        elif model == "gemma4":  # BPE over SentencePiece-style pieces: renders as SPM does
            self.kind = "spm"
        else:
            raise UnsupportedModelError(
                f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2', 'llama', 'bert', 'gemma4')")
        self._spm_bpe = None  # Gemma 4's merges
        add_sep = False  # a [SEP] between a rerank pair's query and document: the kind's default, then the file's
        raw = md.get("tokenizer.ggml.tokens")
        if raw is None or len(raw) == 0:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
        self._tokens: list[str] = [_text(t) for t in raw]
        n = self.vocab_size = len(self._tokens)
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        if len(self._token_to_id) != n:
            raise ModelLoadError("duplicate token text in tokenizer.ggml.tokens")
        types = md.get("tokenizer.ggml.token_type")
        with _key("tokenizer.ggml.token_type"):
            self._attr = ([TYPE_TO_ATTR.get(t, UNDEFINED) for t in _ints(types)[:n]]
                          if types is not None else [NORMAL] * n)
        if len(self._attr) < n:
            raise ModelLoadError("tokenizer.ggml.token_type is shorter than the vocab")

        if self.kind == "bpe":
            pre = pre_type(_text(md.get("tokenizer.ggml.pre", "")))
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError("gpt2 tokenizer without tokenizer.ggml.merges")
            with _key("tokenizer.ggml.merges"):
                merges = [_text(m) for m in merges]
            self._bpe = build_bpe(self._tokens, merges, pre)
            add_sep = pre.add_sep
            defaults = dict(bos=11, eos=11, unk=None)
            add_bos, self.add_space_prefix, self.clean_spaces = pre.add_bos, False, pre.clean_spaces
        elif model == "gemma4":
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError("gemma4 tokenizer without tokenizer.ggml.merges")
            with _key("tokenizer.ggml.merges"):
                self._spm_bpe = build_spm_bpe(self._tokens, [_text(m) for m in merges])
            defaults = dict(bos=None, eos=None, unk=None)
            add_bos, self.add_space_prefix, self.clean_spaces = True, False, True
        elif self.kind == "wpm":  # [CLS] text [SEP]; lowercased and accents stripped unless the file says not
            defaults = dict(bos=101, eos=None, unk=100)
            add_bos, add_sep, self.add_space_prefix, self.clean_spaces = True, True, False, True
            with _key("tokenizer.ggml.normalizer.lowercase"):
                self._lowercase = bool(md.get("tokenizer.ggml.normalizer.lowercase", True))
            with _key("tokenizer.ggml.normalizer.strip_accents"):
                self._strip_accents = bool(md.get("tokenizer.ggml.normalizer.strip_accents", self._lowercase))
        else:
            scores = md.get("tokenizer.ggml.scores")
            self._scores = (scores.tolist() if hasattr(scores, "tolist") else list(scores)) \
                if scores is not None else [0.0] * n
            if len(self._scores) < n:
                raise ModelLoadError("tokenizer.ggml.scores is shorter than the vocab")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in self._scores):
                raise ModelLoadError("tokenizer.ggml.scores must be numbers")  # fuzz: strings there broke encode
            self._ranks = score_ranks(self._scores[:n])
            self._byte_ids = [self._byte_token(b) for b in range(256)]
            defaults = dict(bos=1, eos=2, unk=0)
            add_bos, self.add_space_prefix, self.clean_spaces = True, True, False
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))

        def special(key: str, default: int | None = None) -> int | None:
            v = md.get(f"tokenizer.ggml.{key}_token_id")
            with _key(f"tokenizer.ggml.{key}_token_id"):
                v = None if v is None else int(v)
            if v is not None and 0 <= v < n:
                return v
            return default if default is not None and 0 <= default < n else None

        self.bos_id = special("bos", defaults["bos"])
        self.eos_id = special("eos", defaults["eos"])
        self.unk_id = special("unknown", defaults["unk"])
        self.pad_id = special("padding", 0 if self.kind == "wpm" else None)
        self.sep_id = special("seperator", 102 if self.kind == "wpm" else None)  # llama.cpp's spelling
        # llama.cpp's flags: the kind's defaults, then the file's keys; Gemma 4 starts with BOS whatever the
        # file says (its PR #21500). WordPiece text ignores them (encode_parts); rerank pairs read them.
        self.add_bos = model == "gemma4" or _flag(md, "add_bos_token", add_bos)
        self.add_eos = _flag(md, "add_eos_token", False)
        self.add_sep = _flag(md, "add_sep_token", add_sep)
        if (self.add_bos or self.kind == "wpm") and self.bos_id is None:
            raise ModelLoadError("tokenizer.ggml.add_bos_token is true, but no BOS token is set")
        if self.add_eos and self.eos_id is None and not (self.kind == "wpm" and self.sep_id is not None):
            raise ModelLoadError("tokenizer.ggml.add_eos_token is true, but no EOS token is set")
        if self.kind == "wpm" and self.sep_id is None:  # every WordPiece text ends with it
            raise ModelLoadError("a WordPiece tokenizer needs tokenizer.ggml.seperator_token_id ([SEP])")
        # ids the model must never generate (Gemma 4 12B's file; llama.cpp's samplers give them -inf), those in
        # the vocabulary as llama.cpp keeps them
        v = md.get("tokenizer.ggml.suppress_tokens", [])
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ModelLoadError("GGUF metadata tokenizer.ggml.suppress_tokens must be an array of token ids")
        with _key("tokenizer.ggml.suppress_tokens"):
            self.suppress_ids = tuple(t for t in _ints(v) if 0 <= t < n)

        ids = {k: special(k) for k in AUTO_DETECT}
        for k in ("fim_pre", "fim_suf", "fim_mid"):  # deprecated key names
            old = special({"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}[k])
            ids[k] = ids[k] if ids[k] is not None else old
        for k, texts in AUTO_DETECT.items():
            if ids[k] is None:
                found = [self._token_to_id[t] for t in texts if t in self._token_to_id]
                if found:
                    ids[k] = min(found)
                    self._attr[ids[k]] |= CONTROL  # llama.cpp: "control-looking token"
        self.eot_id = ids["eot"]
        self._find_eog(ids)
        for i in self._special_list(CONTROL):
            if "unused" in self._tokens[i]:
                self._attr[i] |= UNUSED
        # llama.cpp (load's per-token attributes): a model named phi-3 / phi3 drops the whitespace after
        # its special tokens and </s>, but not after <unk>, <s>, <|endoftext|>
        pre, arch = _text(md.get("tokenizer.ggml.pre", "")), _text(md.get("general.architecture", ""))
        if (any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or any(k in arch for k in ("nomic-bert-moe", "jina-bert-v3"))):  # ... and <mask> takes the space before it
            if "<mask>" in self._token_to_id:
                self._attr[self._token_to_id["<mask>"]] |= LSTRIP
        elif any(k in _text(md.get("general.name", "")).lower() for k in ("phi-3", "phi3")):
            for i in self._special_list(SPECIAL) + [self._token_to_id.get("</s>")]:
                if i is not None and self._tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"):
                    self._attr[i] |= RSTRIP
        self._build_special_index()
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        if self.kind == "wpm":
            if self.bos_id is None or self.sep_id is None:
                raise ModelLoadError("a bert vocabulary needs its [CLS] (bos) and [SEP] (seperator) tokens")
            self._wpm = build_wpm(self._tokens, self.unk_id)

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        return cls(md)

    # --- construction helpers -------------------------------------------------------------

    def _byte_token(self, b: int) -> int | None:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        return tid if tid is not None else self._token_to_id.get(chr(b)) if b < 128 else None

    def _special_list(self, mask: int) -> list[int]:
        return [i for i, a in enumerate(self._attr) if a & mask]

    def _find_eog(self, ids: dict[str, int | None]) -> None:
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in EOG_TEXTS:
            i = self._token_to_id.get(t)
            if i is not None:
                eog.add(i)
                self._attr[i] |= CONTROL
        # llama.cpp's "quick hack for gpt-oss": these always render, and split out of plain text (user-defined)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if t in self._token_to_id:
                self._attr[self._token_to_id[t]] = USER_DEFINED
        eog.update(i for i in (self.eos_id, ids["eot"], ids["eom"]) if i is not None)
        text = {self._tokens[i]: i for i in eog}
        # gpt-oss / solar-open: "<|end|>" ends a message there, not the generation.
        if "<|end|>" in text and (("<|return|>" in text and "<|call|>" in text)
                                  or ("<|calls|>" in text and "<|flush|>" in text)):
            eog.discard(text["<|end|>"])
            self._attr[text["<|end|>"]] = USER_DEFINED
        # gemma4 / paddleocr: "</s>" is ordinary text when "<|tool_response>" exists.
        if "<|tool_response>" in text and "</s>" in text:
            eog.discard(text["</s>"])
            self._attr[text["</s>"]] = NORMAL
        self.eog_ids = frozenset(eog)

    def _build_special_index(self) -> None:
        # llama.cpp splits specials longest first; bucket them by their first 3 characters
        # so that encode only tries the few whose start occurs in the text.
        order = sorted(self._special_list(SPECIAL), key=lambda i: -len(self._tokens[i]))
        self._special_rank = {tid: r for r, tid in enumerate(order)}
        self._special_buckets: dict[str, list[int]] = {}
        self._special_short: list[int] = []
        for tid in order:
            t = self._tokens[tid]
            if len(t) < 3:
                self._special_short.append(tid)
            else:
                self._special_buckets.setdefault(t[:3], []).append(tid)

    # --- encode ---------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: special token texts become their ids.
        Without parse_special only user-defined tokens are split (as HF does)."""
        grams = {text[i:i + 3] for i in range(len(text) - 2)}
        cand = [tid for tid in self._special_short if self._tokens[tid] in text]
        for g in grams & self._special_buckets.keys():
            cand.extend(tid for tid in self._special_buckets[g] if self._tokens[tid] in text)
        if not parse_special:
            cand = [tid for tid in cand if not self._attr[tid] & (CONTROL | UNKNOWN)]
        frags: list[str | int] = [text]
        for tid in sorted(cand, key=self._special_rank.__getitem__):
            tok = self._tokens[tid]
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                parts = f.split(tok)
                for j, p in enumerate(parts):
                    if j:
                        out.append(tid)
                        if self._attr[tid] & RSTRIP:
                            p = p.lstrip(_C_SPACE)
                    if j < len(parts) - 1 and self._attr[tid] & LSTRIP:
                        p = p.rstrip(_C_SPACE)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def _encode_text(self, text: str, prev_special: bool) -> list[int]:
        if self.kind == "wpm":
            return wpm_encode(self._wpm, text, lowercase=self._lowercase, strip_accents=self._strip_accents)
        if self.kind == "bpe":
            if len(text) > 4096:  # encode_batch releases the GIL (encode does not): other threads run
                return self._bpe.encode_batch([text], add_special_tokens=False)[0].ids
            return self._bpe.encode(text, add_special_tokens=False).ids
        if self._spm_bpe is not None:
            return spm_bpe_encode(self._spm_bpe, text.replace(" ", _SPACE), self._token_to_id)
        if self.add_space_prefix and prev_special:
            text = " " + text
        return spm_encode(text.replace(" ", _SPACE), self._token_to_id, self._ranks,
                          self._byte_ids)

    def encode(self, text: str, *, add_special: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS (and EOS) as the model's add_bos/add_eos
        say. parse_special: control-token texts in `text` become those tokens; otherwise
        they are tokenized as plain text, so user text cannot inject them."""
        return self.encode_parts([(text, parse_special)], add_special=add_special)

    def encode_parts(self, parts, *, add_special: bool = False) -> list[int]:
        """Token ids of consecutive (text, parse_special) parts: a chat prompt whose template
        text may hold special tokens while the messages' text may not. A part (MEDIA, _) is an
        image's place: MEDIA_ID there, for the caller to replace with the image's tokens."""
        out: list[int] = []
        wpm = self.kind == "wpm"  # llama.cpp's WordPiece: [CLS] text [SEP], whatever add_bos/add_eos say
        if add_special and (self.add_bos or wpm):
            out.append(self.bos_id)
        prev_special = True  # SPM prefixes a space to text at the start or after a special
        for text, parse_special in parts:
            if text is MEDIA:  # an image's place: the text after it is tokenized afresh, as mtmd does
                out.append(MEDIA_ID)
                prev_special = True
                continue
            if not isinstance(text, str):
                raise InvalidRequestError(f"text to tokenize must be a str, not {type(text).__name__}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"text is not valid Unicode: {e.reason} at {e.start}") from e
            for f in (self._partition(text, parse_special) if text else ()):
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    out.extend(self._encode_text(f, prev_special))
                    prev_special = False
        if add_special and wpm:
            out.append(self.sep_id)
        elif add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # --- decode ---------------------------------------------------------------------------

    def token_bytes(self, tid: int, *, special: bool = True) -> bytes:
        """The bytes token `tid` renders as (llama.cpp's token_to_piece). With special=False
        control and unknown tokens render as nothing. A byte token is one byte of UTF-8."""
        key = (tid, special)
        b = self._piece_cache.get(key)
        if b is None:
            b = self._piece_cache[key] = self._render(int(tid), special)
        return b

    def _check_id(self, tid: int) -> int:
        if not 0 <= tid < self.vocab_size:  # also refuses negatives, which would index from the end
            raise InvalidRequestError(f"token id {tid} out of range for a vocab of {self.vocab_size}")
        return tid

    def _render(self, tid: int, special: bool) -> bytes:
        self._check_id(tid)
        attr, text = self._attr[tid], self._tokens[tid]
        if attr & (UNKNOWN | CONTROL):
            return text.encode("utf-8") if special else b""
        if attr & USER_DEFINED:
            return text.encode("utf-8")
        if attr & NORMAL:
            if self.kind == "bpe":
                return bpe_piece_bytes(text)
            return text.replace(_SPACE, " ").encode("utf-8")
        if attr & BYTE:
            # a malformed vocab may mark other text as a byte token: render that text as is
            hex_ok = len(text) == 6 and text[:3] == "<0x" and text[5] == ">" and all(c in _HEX for c in text[3:5])
            return bytes([int(text[3:5], 16)]) if hex_ok else text.encode("utf-8")
        return b""  # unused / undefined tokens render as nothing

    def token_to_piece(self, tid: int, *, special: bool = True) -> str:
        """One token's text; a partial UTF-8 sequence (byte tokens) shows as U+FFFD."""
        return self.token_bytes(tid, special=special).decode("utf-8", "replace")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids` (llama_detokenize). skip_special drops a leading BOS / trailing
        EOS the model adds and renders control tokens as nothing."""
        ids = [int(i) for i in ids]
        strip = self.add_space_prefix  # SPM: the space added before the first word
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, strip = ids[1:], False
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_bytes(i, special=not skip_special) for i in ids]
        if strip and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        text = b"".join(parts).decode("utf-8", "replace")
        return clean_spaces(text) if self.clean_spaces else text

    def vocab_bytes(self) -> list[bytes]:
        """The byte string of every id, for grammar engines (llguidance): control, unknown and
        unused tokens are marked special by a leading 0xFF (never valid UTF-8), so no grammar
        text can produce them; user-defined ones (`<tool_call>`) stay text."""
        out = []
        for tid, (attr, text) in enumerate(zip(self._attr, self._tokens)):
            if attr & (UNKNOWN | CONTROL) or not attr & (NORMAL | USER_DEFINED | BYTE):
                out.append(b"\xff" + text.encode("utf-8"))
            else:
                out.append(self.token_bytes(tid))
        return out

    def encode_text(self, text: str) -> list[int]:
        """Tokens of `text` as a continuation (no BOS, no SPM prefix space, no specials): what a
        grammar engine needs to tokenize the literals it forces."""
        return [t for f in (self._partition(text, False) if text else ()) for t in
                ([f] if isinstance(f, int) else self._encode_text(f, prev_special=False))]

    def is_control(self, tid: int) -> bool:
        return bool(self._attr[self._check_id(tid)] & CONTROL)

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids

    def token_text(self, tid: int) -> str:
        """The raw vocab entry (byte-level / '▁'-escaped form), for debugging."""
        return self._tokens[self._check_id(tid)]

    def token_id(self, text: str) -> int | None:
        """The id whose raw vocab entry is `text` (e.g. '<|im_end|>'), or None."""
        return self._token_to_id.get(text)

    def piece_id(self, text: str) -> int | None:
        """The lowest id that renders exactly as `text` (special tokens spelled out), or None: mtmd's
        lookup_token. Only raw entries that could render so are tried: the text itself (control and
        user-defined tokens), its byte-level or '▁' spelling, its byte token."""
        raw = text.encode("utf-8")
        table = _byte_to_unicode()
        spellings = {text, "".join(table[b] for b in raw), text.replace(" ", _SPACE)}
        if len(raw) == 1:
            spellings.add(f"<0x{raw[0]:02X}>")
        ids = (self._token_to_id.get(t) for t in spellings)
        found = [i for i in ids if i is not None and self.token_bytes(i, special=True) == raw]
        return min(found) if found else None


def vocab_mismatch(model: Tokenizer, draft: Tokenizer) -> str | None:
    """Why `draft`'s vocabulary cannot draft for `model`'s, or None where it can: llama.cpp's
    rule (common_speculative_are_compatible): the same kind and BOS/EOS, sizes within 128
    tokens, and the same token text for every id from 5 on that both have."""
    if model.kind != draft.kind:
        return f"its tokenizer is {draft.kind}, the model's {model.kind}"
    if (model.add_bos, model.bos_id if model.add_bos else None) != (draft.add_bos, draft.bos_id if draft.add_bos else None):
        return f"BOS differs (add_bos {draft.add_bos}, id {draft.bos_id}; the model's {model.add_bos}, {model.bos_id})"
    if model.eos_id != draft.eos_id:
        return f"EOS id {draft.eos_id} differs from the model's {model.eos_id}"
    if abs(model.vocab_size - draft.vocab_size) > 128:
        return f"its vocabulary has {draft.vocab_size} tokens, the model's {model.vocab_size}"
    for i in range(5, min(model.vocab_size, draft.vocab_size)):
        if model._tokens[i] != draft._tokens[i]:
            return f"token {i} is {draft._tokens[i]!r}, the model's {model._tokens[i]!r}"[:300]
    return None


class StreamDecoder:
    """Incremental detokenization for streaming: push() returns only whole characters;
    bytes of a character split across tokens wait for the token that completes it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, *,
                 skip_special: bool = False):
        self._tok = tokenizer
        self._special = not skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        # SPM strips the prefix space of the very first token only; after a prompt the
        # generated text continues it, so nothing is stripped.
        self._strip = tokenizer.add_space_prefix and (prompt_ids is None or len(prompt_ids) == 0)

    def push(self, token_id: int) -> str:
        b = self._tok.token_bytes(token_id, special=self._special)
        if self._strip:
            self._strip = False
            if b[:1] == b" ":
                b = b[1:]
        return self._dec.decode(b)

    def flush(self) -> str:
        """Whatever is left (an incomplete character becomes U+FFFD); resets the decoder."""
        return self._dec.decode(b"", final=True)
