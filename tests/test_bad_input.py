"""Bad input ends in a HearthError that names the problem, never a numpy/struct error or a
crash, and leaves the session usable: empty, non-GGUF, truncated and absurd-count files,
unknown architectures, incomplete llama files (all through the public `Session.open`),
bad requests inside one open session on the real SmolLM2 model, and a fault injected into
one request (its sampler or its token callback raising) on a tiny model."""
from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import anyio
import gguf
import numpy as np
import pytest
from tiny_gguf import write_tiny as write_tiny_model

from hearthlm import (
    BackendError,
    ContextLengthError,
    GGUFError,
    HearthError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    Session,
    SessionClosedError,
    UnsupportedModelError,
)
from hearthlm.model_zoo.gguf_file import GGUFFile

N_CTX = 256


# --- helpers --------------------------------------------------------------------------

async def open_error(model, **kw) -> HearthError:
    """The HearthError that Session.open(model) raises. Any other exception type escapes
    pytest.raises and fails the test: that is the point."""
    kw.setdefault("n_ctx", 64)
    with pytest.raises(HearthError) as ei:
        async with Session.open(str(model), **kw):
            pass
    return ei.value


def assert_names(err: BaseException, cls: type, *words: str, any_of: tuple[str, ...] = ()) -> str:
    msg = str(err)
    assert type(err) is cls or isinstance(err, cls), f"{type(err).__name__} is not a {cls.__name__}: {msg}"
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    if any_of:
        assert any(w.lower() in msg.lower() for w in any_of), f"none of {any_of} in {msg!r}"
    return msg


def _byte_level_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode alphabet: 256 single-character tokens, one per byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


TINY_TOKENS = _byte_level_tokens() + ["Ġt", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TINY_E, TINY_F = 64, 128
TINY_TENSORS = {  # 1 layer, 4 heads of 16, 2 KV heads
    "token_embd.weight": (len(TINY_TOKENS), TINY_E), "output_norm.weight": (TINY_E,),
    "blk.0.attn_norm.weight": (TINY_E,), "blk.0.attn_q.weight": (TINY_E, TINY_E),
    "blk.0.attn_k.weight": (32, TINY_E), "blk.0.attn_v.weight": (32, TINY_E),
    "blk.0.attn_output.weight": (TINY_E, TINY_E), "blk.0.ffn_norm.weight": (TINY_E,),
    "blk.0.ffn_gate.weight": (TINY_F, TINY_E), "blk.0.ffn_up.weight": (TINY_F, TINY_E),
    "blk.0.ffn_down.weight": (TINY_E, TINY_F),
}


def write_tiny(path: Path, *, arch: str = "llama", drop_tensor: str | None = None,
               drop_key: str | None = None, override: dict | None = None) -> Path:
    """A small valid llama-style GGUF (F32 weights, byte-level BPE vocab of 260), with one
    defect on request: another architecture name, a tensor or key left out, a value replaced
    ({key: (kind, value)}, kind in u32/i32/f32/str/arr)."""
    n_vocab = len(TINY_TOKENS)
    kvs = {
        f"{arch}.block_count": ("u32", 1), f"{arch}.context_length": ("u32", 128),
        f"{arch}.embedding_length": ("u32", TINY_E), f"{arch}.feed_forward_length": ("u32", TINY_F),
        f"{arch}.attention.head_count": ("u32", 4), f"{arch}.attention.head_count_kv": ("u32", 2),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
        "tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.pre": ("str", "smollm"),
        "tokenizer.ggml.tokens": ("arr", TINY_TOKENS),
        "tokenizer.ggml.token_type": ("arr", [1] * (n_vocab - 3) + [3] * 3),
        "tokenizer.ggml.merges": ("arr", ["Ġ t"]),
        "tokenizer.ggml.bos_token_id": ("u32", n_vocab - 1), "tokenizer.ggml.eos_token_id": ("u32", n_vocab - 1),
    }
    kvs.update(override or {})
    w = gguf.GGUFWriter(str(path), arch)
    add = {"u32": w.add_uint32, "i32": w.add_int32, "f32": w.add_float32, "str": w.add_string,
           "arr": w.add_array}
    for key, (kind, value) in kvs.items():
        if key != drop_key:
            add[kind](key, value)
    rng = np.random.default_rng(0)
    for name, shape in TINY_TENSORS.items():
        if name != drop_tensor:
            w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def layout(smollm2_path):
    """(file size, data_offset, sorted tensor offsets) of the real model."""
    with GGUFFile.open(smollm2_path) as f:
        offsets = sorted(t.offset for t in f.tensors.values())
        return smollm2_path.stat().st_size, f.data_offset, offsets


def write_prefix(src: Path, dst: Path, n: int, patch: dict[int, int] | None = None) -> Path:
    """The first n bytes of src, with u64 values patched at the given offsets."""
    with open(src, "rb") as f:
        data = bytearray(f.read(n))
    assert len(data) == n
    for off, value in (patch or {}).items():
        struct.pack_into("<Q", data, off, value)
    dst.write_bytes(bytes(data))
    return dst


# --- files: through Session.open --------------------------------------------------------

async def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    assert_names(await open_error(p), GGUFError, "empty", str(p))


async def test_text_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("These are my notes, not a model.\n" * 20)
    assert_names(await open_error(p), GGUFError, "not a GGUF", str(p))


async def test_random_bytes_file(tmp_path):
    p = tmp_path / "noise.gguf"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    assert_names(await open_error(p), GGUFError, "not a GGUF")


# where to cut the real file: a name and a function of (size, data_offset, tensor offsets)
CUTS = {
    "in_magic": lambda size, do, offs: 3,
    "in_version": lambda size, do, offs: 6,
    "in_tensor_count": lambda size, do, offs: 12,
    "in_kv_count": lambda size, do, offs: 20,
    "after_counts": lambda size, do, offs: 24,
    "in_general_metadata": lambda size, do, offs: 200,
    "in_token_list": lambda size, do, offs: 500_000,
    "in_merges": lambda size, do, offs: 1_200_000,
    "in_tensor_infos": lambda size, do, offs: do - 300,
    "end_of_header": lambda size, do, offs: do,
    "in_first_tensor": lambda size, do, offs: do + 1000,
    "in_middle_tensor": lambda size, do, offs: offs[len(offs) // 2] + 100,
    "in_last_tensor": lambda size, do, offs: size - 1,
}


@pytest.mark.parametrize("where", list(CUTS))
async def test_truncated_file(tmp_path, smollm2_path, layout, where):
    size, do, offs = layout
    n = CUTS[where](size, do, offs)
    p = write_prefix(smollm2_path, tmp_path / f"cut_{where}.gguf", n)
    t0 = time.perf_counter()
    err = await open_error(p)
    # "impossible for a N-byte file": a count the remaining bytes cannot hold
    assert_names(err, GGUFError, str(p), any_of=("cut short", "out of file bounds", "impossible for a"))
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("field,offset", [("tensor count", 8), ("metadata count", 16)])
@pytest.mark.parametrize("value", [2**40, 2**63, 2**64 - 1])
async def test_absurd_header_counts(tmp_path, smollm2_path, layout, field, offset, value):
    _, do, _ = layout
    # The whole header, so that the other count is still plausible for the file's size.
    p = write_prefix(smollm2_path, tmp_path / "counts.gguf", do + 4096, patch={offset: value})
    t0 = time.perf_counter()
    err = await open_error(p)
    assert_names(err, GGUFError, field, str(value))
    assert time.perf_counter() - t0 < 5  # refused from the count alone, nothing allocated


@pytest.mark.parametrize("offset,delta", [(8, 1), (8, -1), (16, 1), (16, -1), (16, 5)])
async def test_plausible_but_wrong_counts(tmp_path, smollm2_path, layout, offset, delta):
    _, do, _ = layout
    with open(smollm2_path, "rb") as f:
        (count,) = struct.unpack_from("<Q", f.read(24), offset)
    p = write_prefix(smollm2_path, tmp_path / "off_by.gguf", do + 4096, patch={offset: count + delta})
    assert isinstance(await open_error(p), ModelLoadError)


async def test_tiny_model_is_valid(tmp_path):
    """The control for the tiny-file tests below: without a defect it loads and generates."""
    p = write_tiny(tmp_path / "tiny.gguf")
    async with Session.open(str(p), backend="reference", n_ctx=64) as s:
        c = await s.generate("hi there", max_tokens=3, temperature=0)
        assert len(c.token_ids) == 3 and c.finish_reason == "length"


async def test_unknown_architecture(tmp_path):
    p = write_tiny(tmp_path / "mamba9.gguf", arch="mamba9")
    msg = assert_names(await open_error(p), UnsupportedModelError, "mamba9")
    assert "llama" in msg  # says what is supported


async def test_known_architecture_with_foreign_tensors(tmp_path):
    """A gemma3 header over llama tensors: the first tensor gemma3 needs is named."""
    p = write_tiny(tmp_path / "gemma3.gguf", arch="gemma3")
    assert_names(await open_error(p, backend="reference"), ModelLoadError, "gemma3", "missing")


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output_norm.weight"])
async def test_missing_tensor(tmp_path, tensor):
    p = write_tiny(tmp_path / "no_tensor.gguf", drop_tensor=tensor)
    assert_names(await open_error(p, backend="reference"), ModelLoadError, tensor, "missing")


async def test_missing_embedding(tmp_path):
    p = write_tiny(tmp_path / "no_embd.gguf", drop_tensor="token_embd.weight")
    assert_names(await open_error(p, backend="reference"), ModelLoadError, "token_embd.weight")


async def test_extra_block_count(tmp_path):
    p = write_tiny(tmp_path / "two_blocks.gguf", override={"llama.block_count": ("u32", 2)})
    assert_names(await open_error(p, backend="reference"), ModelLoadError, "blk.1.")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.context_length", "llama.embedding_length",
                                 "tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
async def test_missing_key(tmp_path, key):
    p = write_tiny(tmp_path / "no_key.gguf", drop_key=key)
    assert_names(await open_error(p, backend="reference"), ModelLoadError, key)


@pytest.mark.parametrize("override,cls,word", [
    ({"llama.block_count": ("u32", 0)}, ModelLoadError, "llama.block_count"),
    ({"llama.attention.head_count": ("u32", 3)}, ModelLoadError, "llama"),
    ({"llama.attention.head_count_kv": ("u32", 3)}, ModelLoadError, "llama"),
    ({"tokenizer.ggml.model": ("str", "t5")}, UnsupportedModelError, "t5"),
    ({"tokenizer.ggml.pre": ("str", "weird-pre")}, UnsupportedModelError, "weird-pre"),
    ({"tokenizer.ggml.token_type": ("arr", [1] * 10)}, ModelLoadError, "token_type"),
    ({"tokenizer.ggml.merges": ("arr", ["nospace"])}, ModelLoadError, "merge"),
])
async def test_bad_hyperparameters(tmp_path, override, cls, word):
    p = write_tiny(tmp_path / "bad_hp.gguf", override=override)
    assert_names(await open_error(p, backend="reference"), cls, word)


@pytest.mark.parametrize("key,kind,value", [
    ("llama.context_length", "str", "8k"),
    ("llama.rope.dimension_count", "str", "64"),
    ("tokenizer.ggml.eos_token_id", "str", "x"),
    ("tokenizer.ggml.token_type", "arr", ["a"] * len(TINY_TOKENS)),
    ("tokenizer.ggml.merges", "u32", 5),
    ("llama.embedding_length", "str", "64"),  # "bad llama hyperparameters" (the key is not named)
    ("tokenizer.ggml.model", "u32", 3),
])
async def test_metadata_of_wrong_type(tmp_path, key, kind, value):
    p = write_tiny(tmp_path / "wrong_type.gguf", override={key: (kind, value)})
    err = await open_error(p, backend="reference")
    assert_names(err, ModelLoadError, any_of=(key.split(".")[-1], "hyperparameters"))


async def test_missing_path(tmp_path):
    p = tmp_path / "nowhere" / "model.gguf"
    assert_names(await open_error(p), ModelNotFoundError, "does not exist")


async def test_directory_without_model(tmp_path):
    assert_names(await open_error(tmp_path), ModelNotFoundError, "no .gguf")


async def test_unknown_backend(smollm2_path):
    assert_names(await open_error(smollm2_path, backend="tpu9"), BackendError, "tpu9", "cpu")


async def test_bad_n_ctx(smollm2_path):
    assert_names(await open_error(smollm2_path, n_ctx=1), InvalidRequestError, "n_ctx")


# --- requests: inside one open session on the real model -----------------------------------

MSG = [{"role": "user", "content": "hi"}]

# (name, args, kwargs, error class, words the message must contain)
BAD_REQUESTS = [
    ("prompt longer than the context", ("hello " * 300,), {}, ContextLengthError, ["301", str(N_CTX)]),
    ("ids as long as the context", ([28] * N_CTX,), {}, ContextLengthError, [str(N_CTX), "tokens"]),
    ("prompt + max_tokens over", ([28] * 250,), {"max_tokens": 8}, ContextLengthError, ["250", "8", str(N_CTX)]),
    ("max_tokens over alone", ("hi",), {"max_tokens": 10**6}, ContextLengthError, ["1000000", str(N_CTX)]),
    ("empty prompt", ("",), {}, InvalidRequestError, ["empty"]),
    ("empty id list", ([],), {}, InvalidRequestError, ["empty"]),
    ("id out of vocabulary", ([1, 49152],), {}, InvalidRequestError, ["49152", "vocab"]),
    ("negative id", ([-1],), {}, InvalidRequestError, ["-1", "vocab"]),
    ("huge id", ([2**70],), {}, InvalidRequestError, [str(2**70)]),
    ("ids not ints", (["a", "b"],), {}, InvalidRequestError, ["token ids"]),
    ("prompt an int", (5,), {}, InvalidRequestError, ["prompt"]),
    ("lone surrogate", ("\ud800",), {}, InvalidRequestError, ["unicode"]),
    ("no prompt", (), {}, InvalidRequestError, ["prompt"]),
    ("prompt and messages", ("hi",), {"messages": MSG}, InvalidRequestError, ["one of"]),
    ("temperature -1", ("hi",), {"temperature": -1}, InvalidRequestError, ["temperature"]),
    ("temperature nan", ("hi",), {"temperature": math.nan}, InvalidRequestError, ["temperature"]),
    ("temperature str", ("hi",), {"temperature": "hot"}, InvalidRequestError, []),
    ("top_p 0", ("hi",), {"top_p": 0}, InvalidRequestError, ["top_p"]),
    ("top_k -1", ("hi",), {"top_k": -1}, InvalidRequestError, ["top_k"]),
    ("min_p 2", ("hi",), {"min_p": 2}, InvalidRequestError, ["min_p"]),
    ("repetition_penalty 0", ("hi",), {"repetition_penalty": 0}, InvalidRequestError, ["repetition_penalty"]),
    ("top_logprobs 21", ("hi",), {"top_logprobs": 21}, InvalidRequestError, ["top_logprobs"]),
    ("unknown keyword", ("hi",), {"frobnicate": 1}, InvalidRequestError, ["frobnicate"]),
    ("max_tokens 0", ("hi",), {"max_tokens": 0}, InvalidRequestError, ["max_tokens"]),
    ("max_tokens -3", ("hi",), {"max_tokens": -3}, InvalidRequestError, ["max_tokens"]),
    ("stop ['']", ("hi",), {"stop": [""]}, InvalidRequestError, ["stop"]),
    ("stop ''", ("hi",), {"stop": ""}, InvalidRequestError, ["stop"]),
    ("stop [5]", ("hi",), {"stop": [5]}, InvalidRequestError, ["stop"]),
    ("messages empty", (), {"messages": []}, InvalidRequestError, ["messages"]),
    ("messages a str", (), {"messages": "hi"}, InvalidRequestError, ["list"]),
    ("messages a dict", (), {"messages": {"role": "user", "content": "hi"}}, InvalidRequestError, ["list"]),
    ("messages of str", (), {"messages": ["hi"]}, InvalidRequestError, ["messages[0]", "dict"]),
    ("message without role", (), {"messages": [{"content": "hi"}]}, InvalidRequestError, ["role"]),
    ("message without content", (), {"messages": [{"role": "user"}]}, InvalidRequestError, ["content"]),
    ("content not str", (), {"messages": [{"role": "user", "content": 5}]}, InvalidRequestError, ["content"]),
    ("content None", (), {"messages": [{"role": "user", "content": None}]}, InvalidRequestError, ["content"]),
]


async def test_bad_requests_leave_session_usable(smollm2_path):
    async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
        hello = await s.generate("Hello", max_tokens=2, temperature=0)
        assert len(hello.token_ids) == 2
        for name, args, kwargs, cls, words in BAD_REQUESTS:
            kwargs = {"max_tokens": 2, **kwargs}
            with pytest.raises(HearthError) as ei:  # anything else escapes and fails the test
                await s.generate(*args, **kwargs)
            assert isinstance(ei.value, cls), f"{name}: {type(ei.value).__name__}: {ei.value}"
            for w in words:
                assert w.lower() in str(ei.value).lower(), f"{name}: {w!r} not in {str(ei.value)!r}"
            # the same through stream(): the error comes from the first iteration
            with pytest.raises(cls):
                async for _ in s.stream(*args, **kwargs):
                    pass
            # usable: one token keeps this affordable on a busy machine (a step per check)
            again = await s.generate("Hello", max_tokens=1, temperature=0)
            assert again.token_ids == hello.token_ids[:1], f"session unusable after {name}"
        assert (await s.generate("Hello", max_tokens=2, temperature=0)).token_ids == hello.token_ids
        st = s.stats()
        assert st["kv_blocks_used"] == 0 and st["running_requests"] == 0 and st["queue_depth"] == 0
    with pytest.raises(SessionClosedError):
        await s.generate("Hello", max_tokens=2, temperature=0)
    with pytest.raises(SessionClosedError):
        async for _ in s.stream("Hello", max_tokens=2):
            pass


UNVALIDATED = [
    pytest.param({"seed": "abc"}, id="seed-str"),
    pytest.param({"seed": -1}, id="seed-negative"),
    pytest.param({"max_tokens": "5"}, id="max_tokens-str"),
    pytest.param({"stop": 5}, id="stop-int"),
    pytest.param({"top_k": 2.5, "temperature": 0.5}, id="top_k-float"),
    pytest.param({"top_logprobs": 2.5}, id="top_logprobs-float"),
    pytest.param({"stop_token_ids": 5.0}, id="stop_token_ids-float"),
    pytest.param({"temperature": "hot"}, id="temperature-str"),
    pytest.param({"timeout": "5"}, id="timeout-str"),
    pytest.param({"timeout": math.nan}, id="timeout-nan"),
]


@pytest.mark.parametrize("kwargs", UNVALIDATED)
async def test_unvalidated_request_arguments(smollm2_path, kwargs):
    """Each would fail by itself already at the first request; one session per case."""
    async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
        with pytest.raises(InvalidRequestError) as ei:  # another HearthError or a TypeError escapes
            await s.generate("Hello", **{"max_tokens": 2, **kwargs})
        assert next(iter(kwargs)) in str(ei.value)
        with anyio.move_on_after(2):  # nothing was left running
            while s.stats()["running_requests"] or s.stats()["kv_blocks_used"]:
                await anyio.sleep(0.02)
        assert s.stats()["running_requests"] == 0 and s.stats()["kv_blocks_used"] == 0
        assert len((await s.generate("Hello", max_tokens=1, temperature=0)).token_ids) == 1


# --- fault injection: one request's sampler or token callback raises -------------------

FAULTY_SEED = 666  # marks the faulty request (greedy, so the seed changes nothing else)
# the tiny model greedily repeats its last token; a huge presence penalty makes each step pick
# the best unseen token, so every token depends on the step's logits
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True, presence_penalty=1000.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("fault") / "tiny.gguf", "llama", n_layer=2))


def fault_prompt(i: int) -> list[int]:
    return [3 + (i * 7 + k * 13) % 250 for k in range(12)]


async def run_four(s) -> dict[int, list[int] | BaseException]:
    """Four greedy requests at once; request 2 is the one a fault is injected into."""
    out: dict[int, list[int] | BaseException] = {}

    async def one(i):
        try:
            out[i] = (await s.generate(fault_prompt(i), **GREEDY, seed=FAULTY_SEED if i == 2 else i)).token_ids
        except HearthError as e:
            out[i] = e
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    return out


def fail_after(n: int, fn):
    """fn, raising from its (n+1)-th call on."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] > n:
            raise RuntimeError("injected fault")
        return fn(*a, **kw)
    return wrapped


def inject_sampler_fault(monkeypatch):
    import hearthlm.runtime.output as output
    real = output.sample
    faulty = fail_after(3, real)
    monkeypatch.setattr(output, "sample", lambda lg, p, rng, hist: (faulty if p.seed == FAULTY_SEED else real)(
        lg, p, rng, hist))


def inject_callback_fault(monkeypatch):
    import hearthlm.session as session
    real = session.Request

    def request(**kw):
        if kw["params"].seed == FAULTY_SEED:
            kw["on_token"] = fail_after(3, kw["on_token"])
        return real(**kw)
    monkeypatch.setattr(session, "Request", request)


@pytest.mark.parametrize("inject", [inject_sampler_fault, inject_callback_fault], ids=["sampler", "callback"])
async def test_fault_in_one_request_leaves_the_others_exact(tiny_model, monkeypatch, inject):
    async with Session.open(tiny_model, n_ctx=128) as s:
        clean = await run_four(s)
        assert all(isinstance(v, list) and len(v) == GREEDY["max_tokens"] for v in clean.values())
        inject(monkeypatch)
        faulty = await run_four(s)
        monkeypatch.undo()
        assert isinstance(faulty[2], HearthError) and "injected fault" in str(faulty[2])
        assert {i: faulty[i] for i in (0, 1, 3)} == {i: clean[i] for i in (0, 1, 3)}
        # and the session keeps serving, the faulty request's KV blocks given back
        assert (await s.generate(fault_prompt(2), **GREEDY, seed=FAULTY_SEED)).token_ids == clean[2]
        st = s.stats()
        assert st["running_requests"] == 0 and st["kv_blocks_used"] == 0


async def test_request_in_flight_when_session_exits(smollm2_path):
    """Leaving `async with Session.open(...)` aborts a request another task still awaits."""
    result = {}

    async def run(s):
        try:
            result["value"] = await s.generate("Once upon a time", max_tokens=200, temperature=0)
        except HearthError as e:
            result["value"] = e

    async with anyio.create_task_group() as tg:
        async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
            tg.start_soon(run, s)
            with anyio.fail_after(60):
                while s.stats()["tokens_generated"] == 0:
                    await anyio.sleep(0.02)
    assert isinstance(result["value"], SessionClosedError), repr(result["value"])[:200]
    with pytest.raises(SessionClosedError):
        await s.generate("Hello", max_tokens=1)


async def test_request_in_flight_when_session_closes(smollm2_path):
    result = {}
    async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
        async def run():
            try:
                result["value"] = await s.generate("Once upon a time", max_tokens=200, temperature=0)
            except HearthError as e:
                result["value"] = e

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            async for _ in s.stream("Hi", max_tokens=2, temperature=0):
                pass  # by now `run` has its request in the engine
            await s.aclose()
    assert isinstance(result["value"], SessionClosedError), repr(result["value"])[:200]


# --- architectures: what each describes of its tensors and keys is checked at load ---------

def _arch_file(tmp_path, variant: str, **defects) -> Path:
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "parity"))
    from models import write as write_arch
    return write_arch(tmp_path / f"{variant}.gguf", variant, defects=defects)


@pytest.mark.parametrize("variant,tensor", [("qwen2", "blk.0.attn_q.weight"), ("phi3", "blk.0.attn_qkv.weight"),
                                            ("qwen3moe", "blk.1.ffn_down_exps.weight"),
                                            ("gemma2", "blk.0.post_ffw_norm.weight")])
async def test_architecture_missing_tensor(tmp_path, variant, tensor):
    p = _arch_file(tmp_path, variant, drop=tensor)
    assert_names(await open_error(p, backend="reference"), ModelLoadError, tensor, "missing")


@pytest.mark.parametrize("variant,tensor,shape", [
    ("qwen2", "blk.0.attn_k.bias", (48,)), ("phi3", "blk.1.ffn_up.weight", (96, 64)),
    ("qwen3", "blk.0.attn_q_norm.weight", (8,)), ("qwen3moe", "blk.0.ffn_up_exps.weight", (3, 32, 64))])
async def test_architecture_misshapen_tensor(tmp_path, variant, tensor, shape):
    p = _arch_file(tmp_path, variant, shape={tensor: shape})
    assert_names(await open_error(p, backend="reference"), ModelLoadError, tensor, str(shape))


async def test_optional_bias_may_be_absent(tmp_path):
    """As for llama.cpp's qwen2 (its biases are not required)."""
    p = _arch_file(tmp_path, "qwen2", drop="blk.1.attn_q.bias")
    async with Session.open(str(p), backend="reference", n_ctx=64) as s:
        assert len((await s.generate([5, 6], max_tokens=2, temperature=0)).token_ids) == 2


@pytest.mark.parametrize("metadata,name", [
    ({"expert_used_count": 9}, "qwen3moe.expert_used_count"),   # more than expert_count (4)
    ({"expert_count": 3}, "blk.0.ffn_gate_inp.weight"),          # the tensors hold 4 experts
])
async def test_wrong_expert_count(tmp_path, metadata, name):
    p = _arch_file(tmp_path, "qwen3moe", metadata=metadata)
    assert_names(await open_error(p, backend="reference"), ModelLoadError, name)


async def test_unknown_rope_scaling_type(tmp_path):
    p = _arch_file(tmp_path, "qwen2", metadata={"rope.scaling.type": "dynamic"})
    assert_names(await open_error(p, backend="reference"), ModelLoadError, "qwen2.rope.scaling.type", "dynamic")


async def test_unsupported_architecture_lists_supported(tmp_path):
    p = write_tiny(tmp_path / "rwkv.gguf", arch="rwkv7")
    msg = assert_names(await open_error(p), UnsupportedModelError, "rwkv7")
    assert all(a in msg for a in ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3"))


async def test_unsupported_weight_type_names_type_and_tensor(tmp_path):
    """A file whose matrix is in a type the CPU backend has no kernels for (NVFP4) is refused at
    open, naming the tensor and the type."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "parity"))
    from models import write as write_arch
    tensor = "blk.1.ffn_up.weight"
    p = write_arch(tmp_path / "nvfp4.gguf", "llama",
                   qtypes=lambda name, shape: gguf.GGMLQuantizationType.NVFP4 if name == tensor else None)
    assert_names(await open_error(p, backend="cpu"), UnsupportedModelError, tensor, "NVFP4")


async def test_sliding_pattern_of_the_wrong_length_names_the_key(tmp_path):
    p = _arch_file(tmp_path, "olmo2", metadata={"attention.sliding_window_pattern": [True, False, True]})
    assert_names(await open_error(p, backend="reference"), ModelLoadError, "olmo2.attention.sliding_window_pattern")
