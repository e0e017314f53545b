"""Fuzz target: GGUF files, through GGUFFile.open and load_model (architecture config,
tokenizer metadata, graph check), and a loaded model's first use (encode, decode, chat).

The first byte picks how the file is made:
  0  the rest of the input is the file;
  1  a valid tiny seed with numeric header fields overwritten: counts, string and array
     lengths, value and element types, tensor dims, types and offsets, the alignment;
  2  a seed with typed metadata edits (a key's value replaced by any GGUF value, a key
     removed) and tensor edits (dims, type, name, dropped), written out again as a
     well-formed file, so that the reader accepts it and config/tokenizer reading is reached.
"""
from __future__ import annotations

import functools
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from fuzz.engine import Draw
from hearthlm.model_zoo.chat_template import encode_chat
from hearthlm.model_zoo.gguf_file import _PLAIN_DTYPES, GGUFFile
from hearthlm.model_zoo.model import load_model
from hearthlm.model_zoo.tokenizer import StreamDecoder

NAME = "gguf"
MAX_LEN = 64 * 1024
STRING, ARRAY = 8, 9
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_PATH = Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()) / f"hearthlm-fuzz-{os.getpid()}.gguf"


# --- a valid file's parts, and writing them back -------------------------------------------

def scan(buf: bytes) -> tuple[list, list, list]:
    """(fields, kvs, tensors) of a valid GGUF: fields = (offset, size, kind) of each header
    number (only the first 3 items of an array), kvs = (key, vtype, value) with arrays as
    (etype, items), tensors = (name, ne, type, data bytes)."""
    fields = [(4, 4, "version"), (8, 8, "count"), (16, 8, "count")]
    n_t, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def num(fmt: str, kind: str | None) -> int:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        if kind:
            fields.append((pos, struct.calcsize(fmt), kind))
        pos += struct.calcsize(fmt)
        return v

    def string(record: bool = True) -> str:
        nonlocal pos
        n = num("Q", "strlen" if record else None)
        pos += n
        return buf[pos - n:pos].decode()

    def value(vt: int, key: str, record: bool = True) -> Any:
        if vt == STRING:
            return string(record)
        if vt == ARRAY:
            et, n = num("I", "vtype" if record else None), num("Q", "arrlen" if record else None)
            return et, [value(et, key, record and i < 3) for i in range(n)]
        return num(_FMT[vt], ("alignment" if key == "general.alignment" else "scalar") if record else None)

    kvs = []
    for _ in range(n_kv):
        key = string()
        vt = num("I", "vtype")
        kvs.append((key, vt, value(vt, key)))
    infos = []
    for _ in range(n_t):
        name = string()
        nd = num("I", "ndims")
        ne = [num("Q", "dim") for _ in range(nd)]
        infos.append((name, ne, num("I", "ttype"), num("Q", "toffset")))
    align = dict((k, v) for k, _, v in kvs).get("general.alignment", 32)
    data_at = -(-pos // align) * align
    tensors = [(name, ne, tt, buf[data_at + rel:data_at + rel + _nbytes(ne, tt)])
               for name, ne, tt, rel in infos]
    return fields, kvs, tensors


def _nbytes(ne: list[int], tt: int) -> int:
    block, size = GGML_QUANT_SIZES[T(tt)]
    return int(np.prod(ne[1:], dtype=object)) * (ne[0] // block) * size


def _pack(vt: int, v: Any) -> bytes:
    if vt == STRING:
        b = v.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(b)) + b
    if vt == ARRAY:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(_pack(et, x) for x in items)
    fmt = _FMT.get(vt)
    if fmt is None:  # an unknown type code: some bytes the reader must refuse
        return b"\0" * 8
    if fmt in "fd":
        return struct.pack("<" + fmt, v)
    bits = 8 * struct.calcsize(fmt)
    v %= 1 << bits  # any int, wrapped to the field's width
    return struct.pack("<" + fmt.upper(), v)


def serialize(kvs: list, tensors: list) -> bytes:
    align = next((v for k, vt, v in kvs if k == "general.alignment" and vt in (4, 10)), 32)
    align = align if 0 < align <= 4096 and not align & (align - 1) else 32
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for key, vt, v in kvs:
        out += _pack(STRING, key) + struct.pack("<I", vt) + _pack(vt, v)
    rel, data = 0, bytearray()
    for name, ne, tt, blob in tensors:
        out += _pack(STRING, name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, tt, rel)
        data += blob + b"\0" * (-len(blob) % align)
        rel = len(data)
    out += b"\0" * (-len(out) % align)
    return bytes(out + data)


# --- seeds ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def seed_files() -> tuple[bytes, ...]:
    """Tiny valid files: llama (Q8_0, BPE vocab), gemma3 (F16), llama with an SPM vocab, and
    a file of every value type, nested arrays, alignment 64 and assorted tensor types."""
    from tiny_gguf import write_tiny
    dims = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    with tempfile.TemporaryDirectory() as d:
        llama = write_tiny(Path(d) / "l.gguf", "llama", qtype=T.Q8_0, **dims).read_bytes()
        gemma = write_tiny(Path(d) / "g.gguf", "gemma3", qtype=T.F16, **dims).read_bytes()
    _, kvs, tensors = scan(llama)
    spm_tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"] + \
        [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "\u2581t", "\u2581th", "h", "t"]
    n_spm = len(spm_tokens)
    spm_kvs = [kv for kv in kvs if not kv[0].startswith("tokenizer.ggml")] + [
        ("tokenizer.ggml.model", STRING, "llama"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, spm_tokens)),
        ("tokenizer.ggml.scores", ARRAY, (6, [0.0] * 5 + [-1000.0] * 256 + [-1.0, -2.0, -3.0, -4.0, -5.0])),
        ("tokenizer.ggml.token_type", ARRAY, (5, [2, 3, 3, 3, 3] + [6] * 256 + [1] * 5)),
        ("tokenizer.ggml.bos_token_id", 4, 1), ("tokenizer.ggml.eos_token_id", 4, 2)]
    embd = (b"\x00\x3c" + b"\0" * 32) * n_spm  # Q8_0 rows of 32: scale 1.0, zero codes
    spm_tensors = [("token_embd.weight", [32, n_spm], int(T.Q8_0), embd) if t[0] == "token_embd.weight" else t
                   for t in tensors]
    every = [("general.architecture", STRING, "llama"), ("general.alignment", 4, 64)] + [
        (f"t.{vt}", vt, 1) for vt in _FMT] + [
        ("t.str", STRING, "h\u00e9"), ("t.arr_str", ARRAY, (STRING, ["a", "", "\u2581b"])),
        ("t.arr_nested", ARRAY, (ARRAY, [(4, [1, 2]), (STRING, ["x"])])),
        ("t.arr_bool", ARRAY, (7, [0, 1])), ("t.arr_f64", ARRAY, (12, [0.5]))]
    blobs = [("f32", [3], T.F32), ("f16", [4, 2], T.F16), ("bf16", [4], T.BF16), ("i8", [8], T.I8),
             ("i32", [2], T.I32), ("q4_0", [32], T.Q4_0), ("q4_k", [256], T.Q4_K), ("q8_0", [32, 2], T.Q8_0)]
    every_tensors = [(n, ne, int(tt), bytes(_nbytes(ne, int(tt)))) for n, ne, tt in blobs]
    return llama, gemma, serialize(spm_kvs, spm_tensors), serialize(every, every_tensors)


@functools.lru_cache(maxsize=4)
def _scanned(i: int) -> tuple[list, list, list]:
    return scan(seed_files()[i])


def seeds() -> list[bytes]:
    files = seed_files()
    return ([b"\0" + f for f in files] + [bytes([1, i]) for i in range(len(files))]
            + [bytes([2, i]) for i in range(len(files))])


# --- mutations -----------------------------------------------------------------------------

_EDGES = [0, 1, 2, 3, 7, 8, 12, 13, 31, 32, 33, 63, 64, 255, 256, 4096, 65535, 1 << 31, (1 << 32) - 1,
          1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def field_edits(d: Draw, i: int, log: list) -> bytes:
    fields, _, _ = _scanned(i)
    b = bytearray(seed_files()[i])
    for _ in range(1 + d.int(6)):
        off, size, kind = d.pick(fields)
        op = d.int(6)
        if op == 0:
            v = d.pick(_EDGES + [len(b), len(b) // 8, len(b) - off])
        elif op == 1:
            v = d.u64()
        elif op == 2:
            v = int.from_bytes(b[off:off + size], "little") + d.int(9) - 4
        elif op == 3:
            v = d.int(14) if kind == "vtype" else d.int(42)  # the value / ggml type codes and past them
        elif op == 4:
            cut = off + d.int(size + 1)
            log.append(f"truncate at {cut} ({kind} @{off})")
            return bytes(b[:cut])
        else:  # shift everything after: later offsets and lengths no longer agree
            at, n = off + d.int(size + 1), d.int(16)
            if n < 8:
                b[at:at] = bytes(n + 1)
            else:
                del b[at:at + n - 7]
            log.append(f"{'insert' if n < 8 else 'delete'} {n % 8 + 1} bytes at {at} ({kind} @{off})")
            continue
        v %= 1 << (8 * size)
        log.append(f"{kind} @{off} = {v}")
        b[off:off + size] = v.to_bytes(size, "little")
    return bytes(b)


_KEYS = ["general.architecture", "general.alignment", "{a}.block_count", "{a}.context_length",
         "{a}.embedding_length", "{a}.feed_forward_length", "{a}.attention.head_count",
         "{a}.attention.head_count_kv", "{a}.attention.key_length", "{a}.attention.value_length",
         "{a}.attention.layer_norm_rms_epsilon", "{a}.rope.freq_base", "{a}.rope.dimension_count",
         "{a}.rope.scaling.type", "{a}.rope.scaling.factor", "{a}.attention.sliding_window",
         "{a}.rope.scaling.original_context_length", "{a}.expert_count", "{a}.expert_used_count",
         "{a}.attn_logit_softcapping", "{a}.final_logit_softcapping",
         "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
         "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
         "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
         "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
         "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]
_STRINGS = ["", "llama", "gemma3", "gemma2", "qwen2", "qwen3", "qwen3moe", "phi3", "gpt2", "bert", "llama3",
            "default", "smollm", "linear", "yarn", "longrope",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>", "<0x41>", "\u2581", "\u0120 t", "a b",
            "{{ messages }}", "{% for m in messages %}{{ m.content }}{% endfor %}", "x" * 300]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-5, 0.5, 1e38, 5e-324, float("nan"), float("inf"), float("-inf")]


def typed_value(d: Draw, depth: int = 0) -> tuple[int, Any]:
    vt = d.pick([4, 5, 10, 11, 0, 1, 2, 3, 6, 12, 7, STRING, STRING, ARRAY, ARRAY])
    return vt, _item(d, vt, depth)


def _item(d: Draw, vt: int, depth: int) -> Any:
    if vt == STRING:
        return d.pick(_STRINGS) if d.int(4) else d.bytes(d.int(12)).decode("latin-1")
    if vt == ARRAY:
        et = d.pick([STRING, STRING, 4, 5, 6, 7, 0, 12] + ([ARRAY] if depth < 2 else []))
        n = d.pick([0, 1, 2, 3, 5, 259, 260, 261, 264] if depth == 0 else [0, 1, 2, 3])  # files stay small
        first = _item(d, et, depth + 1)  # long arrays repeat a few drawn items: cheap, and still edgy
        items = [first if i % 3 else _item(d, et, depth + 1) for i in range(n)] if n < 8 else \
            [first if d.int(8) else _item(d, et, depth + 1) for _ in range(n)]
        return et, items
    if vt in (6, 12):
        return d.pick(_FLOATS)
    if vt == 7:
        return d.int(3)
    return d.pick(_EDGES + [-1, -2, 260, 261]) if d.int(4) else d.u64()


def typed_edits(d: Draw, i: int, log: list) -> bytes:
    _, kvs, tensors = _scanned(i)
    kvs, tensors = list(kvs), list(tensors)
    arch = next((v for k, _, v in kvs if k == "general.architecture"), "llama")
    for _ in range(1 + d.int(6)):
        op = d.int(8)
        if op <= 3:  # replace or add a key: mostly ones the loader reads
            key = d.pick(_KEYS).format(a=arch) if op else d.pick(kvs)[0] if kvs else "x"
            vt, v = typed_value(d)
            kvs = [kv for kv in kvs if kv[0] != key] + [(key, vt, v)]
            log.append(f"set {key} = {_short((vt, v))}")
        elif op == 4 and kvs:
            key = d.pick(kvs)[0]
            kvs = [kv for kv in kvs if kv[0] != key]
            log.append(f"delete {key}")
        elif tensors:
            j = d.int(len(tensors))
            name, ne, tt, blob = tensors[j]
            if op == 5:
                ne = list(ne)
                ne[d.int(len(ne))] = d.pick([1, 2, 8, 16, 31, 32, 33, 64, 96, 260, 261, 1 << 20])
                log.append(f"tensor {name} dims {ne}")
            elif op == 6:
                tt = d.pick([0, 1, 2, 6, 8, 12, 14, 24, 26, 30, 39])
                log.append(f"tensor {name} type {T(tt).name}")
            else:
                tensors.pop(j)
                log.append(f"drop tensor {name}")
                continue
            try:
                size = _nbytes(ne, tt)
            except (KeyError, ValueError):
                size = len(blob)
            # keep the file small; a tensor past the end of the file is the reader's to refuse
            blob = (blob + bytes(max(0, size - len(blob))))[:size] if size <= 1 << 20 else blob
            tensors[j] = (name, ne, tt, blob)
    return serialize(kvs, tensors)


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) < 120 else r[:117] + "..."


def make_file(data: bytes) -> tuple[bytes, list[str]]:
    d = Draw(data)
    mode = d.int(3)
    if mode == 0:
        return d.rest(), ["raw bytes"]
    i = d.int(len(seed_files()))
    log = [f"seed {i}"]
    return (field_edits if mode == 1 else typed_edits)(d, i, log), log


# --- the target ----------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]


def one_input(data: bytes) -> None:
    buf, _ = make_file(data)
    _PATH.write_bytes(buf)
    try:
        check_file(_PATH)
    finally:
        _PATH.unlink()  # what is mapped stays readable


def check_file(path: Path) -> None:
    with GGUFFile.open(path) as f:
        for t in f.tensors.values():
            raw = t.raw()
            assert raw.nbytes == t.nbytes and raw.base is not None, t
            raw[-1:].tobytes()  # the last row lies inside the file
            if t.ggml_type in _PLAIN_DTYPES:
                assert t.array().shape == t.shape
        repr(f)
    model = load_model(path)
    try:
        tok = model.tokenizer
        ids = tok.encode("Hello <|im_start|> w\u00f6rld \u2581 <s>", add_special=True, parse_special=True)
        assert all(0 <= i < tok.vocab_size for i in ids), ids
        text = tok.decode(ids + list(range(min(tok.vocab_size, 400))))
        dec = StreamDecoder(tok)
        assert isinstance("".join(dec.push(i) for i in ids) + dec.flush(), str) and isinstance(text, str)
        if model.chat_template:
            encode_chat(tok, model.chat_template, MESSAGES)
    finally:
        model.close()


def describe(data: bytes) -> str:
    buf, log = make_file(data)
    return f"{len(buf)}-byte file; " + "; ".join(log)
