"""Tokenizers from GGUF metadata against llama.cpp: the real SmolLM2 (gpt2 BPE) and Gemma 3
(SPM) vocabularies must give llama.cpp's ids exactly (tests/data holds the golden records),
and tiny synthetic vocabularies pin the rules (special tokens, byte fallback, merge by
score, end-of-generation, streaming) without any model installed."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from hearthlm.core.errors import UnsupportedModelError
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.model_zoo.tokenizer import StreamDecoder, Tokenizer
from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode
from hearthlm.model_zoo.tokenizer_rules import clean_spaces

DATA = Path(__file__).parent / "data"
SMOL = "SmolLM2-135M-Instruct.Q4_1"
GEMMA = "gemma-3-270m-q4_k_m"
QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def smol_md(smollm2_path) -> dict:  # conftest: a missing model fails under HEARTHLM_REQUIRE_MODELS=1
    return GGUFFile.open(smollm2_path).metadata


@pytest.fixture(scope="module")
def gemma_md(gemma3_path) -> dict:
    return GGUFFile.open(gemma3_path).metadata


@pytest.fixture(scope="module")
def qwen(qwen2_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile.open(qwen2_path).metadata)


@pytest.fixture(scope="module")
def smol(smol_md) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_md)


@pytest.fixture(scope="module")
def gemma(gemma_md) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_md)


def _cases(name: str, kind: str) -> list[dict]:
    file = f"tok_{name}.visible.json" if kind == "tok" else f"prompt_ids_{name}.json"
    return json.loads((DATA / file).read_text())["cases"]


def _stream(tok: Tokenizer, ids, **kw) -> str:
    sd = StreamDecoder(tok, **kw)
    return "".join(sd.push(i) for i in ids) + sd.flush()


# --- real models against llama.cpp ---------------------------------------------------------

@pytest.mark.parametrize("model", ["smol", "gemma", "qwen"])
def test_golden_ids_and_decode(model, request):
    tok = request.getfixturevalue(model)
    for c in _cases({"smol": SMOL, "gemma": GEMMA, "qwen": QWEN}[model], "tok"):
        assert tok.encode(c["text"]) == c["ids"], c["text"]
        assert tok.decode(c["ids"]) == c["decoded"], c["text"]
        assert _stream(tok, c["ids"]) == c["decoded"], c["text"]


@pytest.mark.parametrize("model", ["smol", "gemma"])
def test_golden_prompt_ids(model, request):
    tok = request.getfixturevalue(model)
    for c in _cases(SMOL if model == "smol" else GEMMA, "prompt"):
        assert tok.encode(c["prompt"], add_special=True, parse_special=True) == c["prompt_ids"]


def test_smollm2_vocab_facts(smol, smol_md):
    assert (smol.vocab_size, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, 1, 2, False)
    # eos <|im_end|>, <|endoftext|>, and <reponame> (llama.cpp's FIM-repo auto-detection)
    assert smol.eog_ids == {0, 2, 4}
    assert smol.is_control(1) and not smol.is_control(19556)
    t = time.perf_counter()
    Tokenizer.from_gguf_metadata(smol_md)
    assert time.perf_counter() - t < 1.0, "building the SmolLM2 tokenizer must stay fast"


def test_special_tokens_are_not_injected(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(plain) == text
    assert smol.encode(text, parse_special=True) == [1, 4093, 198, 6004, 2]
    assert smol.decode([1, 4093, 2]) == "<|im_start|>user<|im_end|>"
    assert smol.decode([1, 4093, 2], skip_special=True) == "user"
    assert smol.token_to_piece(2) == "<|im_end|>" and smol.token_to_piece(216) == " "


def test_qwen_golden_prompt_ids(qwen):
    """Generation prompts as llama.cpp tokenized them (no BOS: add_bos_token is false)."""
    cases = json.loads((DATA / f"{QWEN}.visible.json").read_text())["cases"]
    for c in cases:
        assert qwen.encode(c["prompt"], add_special=True, parse_special=True) == c["prompt_ids"]
    assert (qwen.vocab_size, qwen.eos_id, qwen.add_bos) == (151936, 151645, False)
    assert qwen.encode("<|im_start|>", parse_special=True) == [151644]


def test_gemma_vocab_facts(gemma):
    assert (gemma.vocab_size, gemma.bos_id, gemma.eos_id, gemma.add_bos) == (262144, 2, 1, True)
    assert {1, 106} <= gemma.eog_ids  # <eos>, <end_of_turn>
    assert gemma.encode("Hi", add_special=True)[0] == 2
    assert gemma.decode(gemma.encode("Hi there", add_special=True), skip_special=True) == "Hi there"
    assert gemma.encode("<start_of_turn>", parse_special=True) == [105]
    assert 105 not in gemma.encode("<start_of_turn>")


def test_gemma_round_trip_and_byte_fallback(gemma):
    text = "\ue000 private use, \x07 bell, Ω≈ç√ ∫˜ µ≤ 𝔘𝔫𝔦 \U0010FFFD ok\n\n\t end"
    ids = gemma.encode(text)
    assert gemma.decode(ids) == text
    assert _stream(gemma, ids) == text


def test_gemma_encode_speed(gemma):
    text = " ".join(c["text"] for c in _cases(GEMMA, "tok")) * 4
    ids = gemma.encode(text, parse_special=True)
    assert len(ids) >= 500
    best = min(_timed(gemma.encode, text, parse_special=True) for _ in range(3))
    assert best < 0.05, f"{len(ids)} tokens took {best * 1e3:.1f} ms"


def _timed(fn, *a, **kw) -> float:
    t = time.perf_counter()
    fn(*a, **kw)
    return time.perf_counter() - t


# --- synthetic vocabularies: the rules, no model needed ------------------------------------

def spm_md(extra_tokens, *, add_space_prefix=False, numpy=False) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for text, score, ttype in extra_tokens:
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.add_space_prefix": add_space_prefix}
    if numpy:
        md["tokenizer.ggml.scores"] = np.array(scores, dtype=np.float32)
        md["tokenizer.ggml.token_type"] = np.array(types, dtype=np.int32)
        md["tokenizer.ggml.bos_token_id"] = np.uint32(1)
    return md


def test_spm_merges_by_score_not_viterbi():
    # "bc" outscores "ab", so llama.cpp merges it first and "abc" ends as a + bc, although
    # a unigram Viterbi would take ab + c (-1 + 0 > -3 - 3).
    md = spm_md([("a", -3, 1), ("b", -3, 1), ("c", 0, 1), ("ab", -1, 1), ("bc", -0.5, 1)])
    tok = Tokenizer.from_gguf_metadata(md)
    a, bc = tok.token_id("a"), tok.token_id("bc")
    assert tok.encode("abc") == [a, bc]


@pytest.mark.parametrize("numpy", [False, True])
def test_spm_byte_fallback_space_prefix_and_bos(numpy):
    md = spm_md([("▁", -1, 1), ("h", -2, 1), ("i", -2, 1), ("hi", -1.5, 1), ("▁hi", -0.1, 1),
                 ("<|im_end|>", 0, 3), ("<tool>", 0, 4)], add_space_prefix=True, numpy=numpy)
    tok = Tokenizer.from_gguf_metadata(md)
    hi = tok.token_id("▁hi")
    assert tok.encode("hi", add_special=True) == [1, hi]           # BOS + space prefix
    assert tok.decode([hi]) == "hi"                                 # prefix space removed
    # llama.cpp strips it only from a first token that is not a skipped BOS
    assert tok.decode([1, hi], skip_special=True) == " hi"
    assert tok.decode([1, hi]) == "<s> hi"
    # no "▁h" in the vocab, so nothing merges; é is not a token: two byte tokens
    assert tok.encode("hé") == [tok.token_id("▁"), tok.token_id("h"), 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(tok.encode("hé")) == "hé"
    # user-defined tokens split out even unparsed; control ones only with parse_special
    tool, end = tok.token_id("<tool>"), tok.token_id("<|im_end|>")
    assert tok.encode("hi<tool>hi") == [hi, tool, hi]  # text after a special: space prefix
    assert end not in tok.encode("hi<|im_end|>")
    assert tok.encode("hi<|im_end|>", parse_special=True) == [hi, end]
    assert tok.eog_ids == {2, end}
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])


def test_spm_text_after_special_gets_space_prefix():
    md = spm_md([("▁", -1, 1), ("x", -1, 1), ("▁x", -0.5, 1), ("<sep>", 0, 3)],
                add_space_prefix=True)
    tok = Tokenizer.from_gguf_metadata(md)
    x, spx, sep = tok.token_id("x"), tok.token_id("▁x"), tok.token_id("<sep>")
    assert tok.encode("x<sep>x", parse_special=True) == [spx, sep, spx]
    assert x not in tok.encode("x<sep>x", parse_special=True)


def bpe_md(pre="gpt2", merges=(), extra=()) -> dict:
    byte_chars = [_byte_to_unicode()[b] for b in range(256)]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars + merged + list(extra)
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": np.array(types),
            "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


@pytest.mark.parametrize("pre", ["gpt2", "gpt-2", "jina-v1-en", "smollm", "llama3", "llama-bpe", "qwen2",
                                 "default", "starcoder", "falcon"])
def test_bpe_pre_types_round_trip(pre):
    tok = Tokenizer.from_gguf_metadata(bpe_md(pre, merges=["h e", "l l", "he ll", "Ġ w"]))
    text = "hello world 123 it's naïve 日本\n\t<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.token_id("hell") in ids and tok.token_id("Ġw") in ids
    assert tok.add_bos == (pre in ("llama3", "llama-bpe"))
    assert tok.encode("x<|im_end|>", parse_special=True)[-1] == 2
    assert tok.eog_ids == {0, 2}


def test_bpe_digits_split_per_pre_type():
    md = bpe_md("smollm", merges=["1 2", "12 3"])
    assert len(Tokenizer.from_gguf_metadata(md).encode("123")) == 3  # \p{N} one by one
    md["tokenizer.ggml.pre"] = "gpt2"
    assert len(Tokenizer.from_gguf_metadata(md).encode("123")) == 1


def test_unsupported_tokenizers_are_named():
    with pytest.raises(UnsupportedModelError, match="'t5'"):  # UGM (T5's unigram): not yet
        Tokenizer.from_gguf_metadata({**bpe_md(), "tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModelError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata(bpe_md("no-such-pre"))


def test_stream_decoder_holds_partial_characters():
    tok = Tokenizer.from_gguf_metadata(bpe_md())
    ids = tok.encode("a😀b")
    assert len(ids) == 6  # 'a', four bytes of the emoji, 'b'
    sd = StreamDecoder(tok, prompt_ids=[1])
    deltas = [sd.push(i) for i in ids]
    assert deltas == ["a", "", "", "", "😀", "b"]
    assert sd.flush() == ""
    sd.push(ids[1])
    assert sd.flush() == "\ufffd"  # a cut-off character comes out as U+FFFD at the end


def test_clean_spaces_like_llama_cpp():
    assert clean_spaces("Hello , world !") == "Hello, world!"
    assert clean_spaces("it 's , they 're , I 'm , we 've") == "it's, they're, I'm, we've"
    assert clean_spaces("don 't , he 'd , you 'll") == "don 't, he 'd, you 'll"
    assert clean_spaces("a ' b") == "a'b"
    assert clean_spaces("") == "" and clean_spaces(" ") == " "


@pytest.mark.parametrize("pre", ["gpt-4o"])
def test_bpe_pre_types_match_llama_cpp(pre, tmp_path):
    """Token ids as llama.cpp's (tests/parity/record_bpe_pre.py) on a tiny vocabulary whose merges
    a wrong split would keep from applying: case changes inside words, contractions, digit groups."""
    import gguf
    from tiny_gguf import write_tiny
    data = json.loads((Path(__file__).parent / "data" / "bpe_pre_parity.json").read_text())
    path = write_tiny(tmp_path / "t.gguf", pre=pre, merges=tuple(data["merges"]))
    r = gguf.GGUFReader(str(path))
    md = {k: (f.contents() if hasattr(f, "contents") else None) for k, f in r.fields.items() if k.startswith("tokenizer.")}
    tok = Tokenizer.from_gguf_metadata(md)
    for text, want in data[pre]:
        assert tok.encode(text) == want, text


def test_gemma4_spm_style_bpe_matches_llama_cpp():
    """Gemma 4's tokenizer (model "gemma4"): merges over raw UTF-8 with spaces as U+2581, newline runs
    apart (a run that is a token taken whole), <0xXX> byte tokens for characters the vocab lacks, BOS
    whatever the file says: ids as llama.cpp's (tests/parity/record_gemma4_tokenizer.py); and back to text."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "parity"))
    from record_gemma4_tokenizer import metadata

    md = metadata()
    md["tokenizer.ggml.token_type"] = np.array(md["tokenizer.ggml.token_type"])
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.add_bos and tok.bos_id == 2
    for text, want in json.loads((Path(__file__).parent / "data" / "gemma4_tokenizer.json").read_text()):
        got = tok.encode(text, add_special=True, parse_special=True)
        assert got == want, text
        assert tok.decode(got, skip_special=True) == text.replace("<turn|>", "")


@pytest.mark.parametrize("kind, keys, want", [
    # (kind, the file's add_* keys, llama.cpp's (add_bos, add_eos, add_sep)): its defaults per kind, then the keys
    ("spm", {}, (True, False, False)),
    ("spm", {"add_bos_token": False, "add_eos_token": True}, (False, True, False)),
    ("bpe", {}, (False, False, False)),
    ("bpe-llama3", {}, (True, False, False)),
    ("bpe-roberta", {}, (False, False, True)),
    ("bpe-roberta", {"add_sep_token": False, "add_eos_token": True}, (False, True, False)),
    ("bpe", {"add_bos_token": True, "add_sep_token": True}, (True, False, True)),
])
def test_special_token_flags_as_llama_cpp_reads_them(kind, keys, want):
    """Mutation: reading add_sep only from the pre-tokenizer (as before #37) fails the add_sep_token rows."""
    md = spm_md([]) if kind == "spm" else bpe_md({"bpe": "gpt2", "bpe-llama3": "llama-bpe",
                                                  "bpe-roberta": "roberta-bpe"}[kind])
    md["tokenizer.ggml.seperator_token_id"] = 2
    md.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    tok = Tokenizer(md)
    assert (tok.add_bos, tok.add_eos, tok.add_sep) == want
    ids = tok.encode("ab", add_special=True)
    assert (ids[0] == tok.bos_id) == want[0] and (ids[-1] == tok.eos_id) == want[1]


def test_token_attribute_rules_by_name_as_llama_cpp():
    """llama.cpp's per-token rules in load(), on the converted phi3 and gpt-oss files (tests/parity/hf), with
    its ids: a model named phi3 drops the whitespace after its special tokens (but <unk>, <s>, <|endoftext|>);
    <|channel|>, <|message|>, <|start|>, <|constrain|> are user-defined whatever the file says (gpt-oss), so
    they split out of plain text and always render. Mutations: without either rule these ids differ."""
    conv = DATA / "converted"
    phi3 = Tokenizer.from_gguf_metadata(GGUFFile.open(conv / "phi3.gguf").metadata)
    assert phi3.encode("<|user|>\nHello  there<|end|>\n<|assistant|>\n", parse_special=True) == [6, 311, 315, 266,
                                                                                               289, 5, 4]
    assert phi3.encode("a </s> b <|endoftext|> c <s> d", parse_special=True) == [267, 315, 2, 315, 335, 315, 3, 315,
                                                                                   293, 315, 1, 315, 294]
    oss = Tokenizer.from_gguf_metadata(GGUFFile.open(conv / "gpt-oss.gguf").metadata)
    assert oss.encode("<|start|>assistant<|channel|>final<|message|>hi<|end|>") == [
        3, 72, 90, 90, 341, 91, 72, 352, 6, 77, 271, 72, 83, 4, 79, 80, 5]
    assert [oss.token_to_piece(t, special=False) for t in (3, 4, 6, 2)] == ["<|start|>", "<|message|>", "<|channel|>", ""]


@pytest.mark.parametrize("pre, strips", [("jina-v2-code", True), ("gpt2", False)])
def test_mask_takes_the_space_before_it_for_jina_v2_code(pre, strips):
    """llama.cpp's load(): for jina-v2-de/es/code vocabularies <mask> is LSTRIP, so the whitespace before it
    goes with it. Mutation: without that rule the jina case keeps a space token before <mask>."""
    md = bpe_md(pre, extra=("<mask>",))
    md["tokenizer.ggml.token_type"][-1] = 3  # control
    tok = Tokenizer(md)
    mask = tok._token_to_id["<mask>"]
    want = tok.encode("a" if strips else "a ") + [mask] + tok.encode(" b")
    assert tok.encode("a  <mask> b", parse_special=True) == (want if strips else tok.encode("a  ") + [mask] + tok.encode(" b"))
