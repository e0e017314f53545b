"""A validating GGUF reader (v2, v3; little-endian), after llama.cpp's `gguf.cpp`.

Why not `gguf.GGUFReader`: on a malformed file it raises numpy/struct errors or tries
absurd allocations. Here every count is bounded by the bytes left before anything is
allocated, and every problem becomes a `GGUFError` naming the file, the offset and what
was wrong. The header is parsed with `struct` over one memoryview (the 262144-entry
token arrays of real vocabularies parse in one tight loop); tensor data stays in the
file's single read-only memmap.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hearthlm.core.errors import GGUFError, ModelLoadError, ModelNotFoundError, UnsupportedModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4          # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4  # a chain of nested arrays must not exhaust the Python stack

# GGUF value type codes (gguf.constants.GGUFValueType)
STRING, ARRAY, BOOL = 8, 9, 7
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
            10: "<Q", 11: "<q", 12: "<d"}
_SCALARS = {code: struct.Struct(fmt) for code, fmt in _SCALARS.items()}
_ARRAY_DTYPES = {code: np.dtype(st.format) for code, st in _SCALARS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# Tensor types that have a plain numpy dtype (BF16 has none: raw uint16 bits).
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.BF16: np.dtype("<u2"),
    GGMLQuantizationType.I8: np.dtype("i1"), GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"), GGMLQuantizationType.I64: np.dtype("<i8"),
}


def _human(nbytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.0f} {unit}"
    return f"{nbytes}-byte"


class _Mapping:
    """The file's one memmap, shared by its TensorInfos; close() drops it. Views already
    handed out keep the pages alive themselves (numpy refuses to unmap under them)."""

    def __init__(self, path: Path, mm: np.memmap | None):
        self.path, self.mm = path, mm

    def get(self) -> np.memmap:
        if self.mm is None:
            raise ModelLoadError(f"{self.path}: GGUF file is closed")
        return self.mm


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: GGUF ne reversed, e.g. token_embd (49152, 576)
    offset: int             # absolute byte offset in the file
    nbytes: int
    _mapping: _Mapping | None = field(default=None, repr=False, compare=False)

    def raw(self) -> np.ndarray:
        """Read-only uint8 view (n_rows, row_bytes): one row = one ne0 run of blocks."""
        if self._mapping is None:
            raise ModelLoadError(f"tensor {self.name!r} is not attached to a file")
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        row_bytes = self.shape[-1] // block * type_size
        data = self._mapping.get()[self.offset:self.offset + self.nbytes].view(np.ndarray)
        return data.reshape(self.nbytes // row_bytes, row_bytes)

    def array(self) -> np.ndarray:
        """Typed read-only view in `shape`; quantized types have no such view."""
        dtype = _PLAIN_DTYPES.get(self.ggml_type)
        if dtype is None:
            raise UnsupportedModelError(
                f"tensor {self.name!r} is {self.ggml_type.name}, a block-quantized type: "
                f"use raw() and a dequantizer")
        return self.raw().reshape(-1).view(dtype).reshape(self.shape)


class _Cursor:
    """Bounds-checked little-endian reads over the header."""

    def __init__(self, path: Path, mv: memoryview):
        self.path, self.mv, self.size, self.pos = path, mv, len(mv), 0

    def fail(self, problem: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {problem} (at offset {self.pos if at is None else at})")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: cut short: {what} needs {n} bytes at offset "
                            f"{self.pos}, file has {self.size}")

    def bound(self, count: int, min_item: int, what: str) -> None:
        # Every item takes at least min_item bytes: refuse counts the file cannot hold.
        if count * min_item > self.size - self.pos:
            raise self.fail(f"{what} {count} impossible for a {_human(self.size)} file")

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        self.need(st.size, what)
        values = st.unpack_from(self.mv, self.pos)
        self.pos += st.size
        return values

    def u32(self, what: str) -> int:
        return self.unpack(_U32, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack(_U64, what)[0]

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, what)
        start = self.pos
        try:
            text = str(self.mv[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason})", start) from None
        self.pos = start + n
        return text

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        st = _SCALARS.get(vtype)
        if st is not None:
            (v,) = self.unpack(st, what)
            if vtype == BOOL:
                if v > 1:
                    raise self.fail(f"{what}: bool value {v} is not 0 or 1", self.pos - 1)
                return bool(v)
            return v
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            return self.array(what, depth)
        raise UnsupportedModelError(f"{self.path}: {what} has unknown value type {vtype} "
                                    f"(at offset {self.pos - 4})")

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        etype = self.u32(f"{what} element type")
        n = self.u64(f"{what} array length")
        dtype = _ARRAY_DTYPES.get(etype)
        if dtype is not None:
            self.bound(n, dtype.itemsize, f"{what}: array length")
            arr = np.frombuffer(self.mv, dtype, n, self.pos).copy()  # copy: no tie to the mmap
            if etype == BOOL:
                if n and arr.max() > 1:
                    raise self.fail(f"{what}: bool array holds values other than 0 and 1")
                arr = arr.astype(np.bool_)
            self.pos += n * dtype.itemsize
            return arr
        if etype == STRING:
            self.bound(n, 8, f"{what}: array length")
            return self.string_array(n, what)
        if etype == ARRAY:
            self.bound(n, 12, f"{what}: array length")
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]
        raise UnsupportedModelError(f"{self.path}: {what} has unknown array element type "
                                    f"{etype} (at offset {self.pos - 12})")

    def string_array(self, n: int, what: str) -> list[str]:
        # The hot loop of loading (vocabularies, merges): locals only, one try.
        mv, size, pos, unpack = self.mv, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        i = start = 0
        try:
            for i in range(n):
                if size - pos < 8:
                    self.pos = pos
                    self.need(8, f"{what}[{i}] length")
                (ln,) = unpack(mv, pos)
                start = pos + 8
                pos = start + ln
                if pos > size:
                    self.pos = start
                    self.need(ln, f"{what}[{i}]")
                append(str(mv[start:pos], "utf-8"))
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}[{i}] is not UTF-8 ({e.reason})", start) from None
        self.pos = pos
        return out


class GGUFFile:
    """A parsed GGUF header plus the file's memmap. Use `GGUFFile.open(path)`."""

    def __init__(self, path: Path, version: int, alignment: int, data_offset: int,
                 metadata: dict[str, Any], tensors: dict[str, TensorInfo], mapping: _Mapping):
        self.path, self.version, self.alignment = path, version, alignment
        self.data_offset = data_offset  # where tensor data starts (aligned end of header)
        self.metadata, self.tensors, self._mapping = metadata, tensors, mapping

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        path = Path(path)
        try:
            if path.is_dir():
                raise GGUFError(f"{path}: is a directory, not a GGUF file")
            size = path.stat().st_size
        except FileNotFoundError:
            raise ModelNotFoundError(f"{path}: no such file") from None
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read: {e}") from e
        if size == 0:
            raise GGUFError(f"{path}: empty file (0 bytes), not a GGUF file")
        try:
            mm = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot map: {e}") from e
        mapping = _Mapping(path, mm)
        with memoryview(mm) as mv:
            return cls._parse(_Cursor(path, mv), mapping)

    @classmethod
    def _parse(cls, cur: _Cursor, mapping: _Mapping) -> GGUFFile:
        path = cur.path
        cur.need(4, "magic")
        magic = bytes(cur.mv[:4])
        if magic != MAGIC:
            raise GGUFError(f"{path}: bad magic {magic!r}: not a GGUF file")
        cur.pos = 4
        version = cur.u32("version")
        if version not in VERSIONS:
            if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
                raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        cur.bound(n_tensors, 32, "tensor count")  # name len 8, n_dims 4, ne0 8, type 4, offset 8
        cur.bound(n_kv, 13, "metadata count")     # key len 8, type 4, value >= 1

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key_at = cur.pos
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise cur.fail(f"duplicate metadata key {key!r}", key_at)
            metadata[key] = cur.value(cur.u32(f"type of {key!r}"), repr(key))

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")

        infos = [cls._tensor_info(cur, i) for i in range(n_tensors)]
        data_offset = -(-cur.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, rel, nbytes, at in infos:
            if name in tensors:
                raise cur.fail(f"duplicate tensor name {name!r}", at)
            if rel % alignment:
                raise cur.fail(f"tensor {name!r} data offset {rel} is not a multiple of "
                               f"the alignment {alignment}", at)
            offset = data_offset + rel
            if offset + nbytes > cur.size:
                raise GGUFError(f"{path}: tensor data of {name!r} ({nbytes} bytes at offset "
                                f"{offset}) out of file bounds: file has {cur.size} bytes")
            tensors[name] = TensorInfo(name, ggml_type, shape, offset, nbytes, mapping)
        return cls(path, version, alignment, data_offset, metadata, tensors, mapping)

    @staticmethod
    def _tensor_info(cur: _Cursor, i: int) -> tuple:
        at = cur.pos
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r} dims count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS} allowed)")
        ne = cur.unpack(struct.Struct(f"<{n_dims}Q"), f"tensor {name!r} dims")
        if any(d == 0 or d >= 1 << 63 for d in ne):  # >= 2**63 is negative as ggml's int64
            raise cur.fail(f"tensor {name!r} has zero or negative dims {list(ne)}")
        raw_type = cur.u32(f"tensor {name!r} type")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise UnsupportedModelError(f"{cur.path}: tensor {name!r} has unknown ggml type "
                                        f"{raw_type}") from None
        if ne[0] % block:
            raise cur.fail(f"tensor {name!r} row length {ne[0]} is not a multiple of the "
                           f"{ggml_type.name} block size {block}")
        rel = cur.u64(f"tensor {name!r} offset")
        nbytes = ne[0] // block * type_size
        for d in ne[1:]:
            nbytes *= d
        return name, ggml_type, tuple(reversed(ne)), rel, nbytes, at

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def identity(self) -> dict[str, Any]:
        """What names this file's contents for caches built from it: its path, size, mtime,
        and a hash of its first 64 KiB and its tensor table."""
        st = self.path.stat()
        h = hashlib.sha256(bytes(self._mapping.get()[:min(1 << 16, self.data_offset)]))
        for t in self.tensors.values():
            h.update(f"{t.name}|{int(t.ggml_type)}|{t.shape}|{t.offset}\n".encode())
        return dict(path=str(self.path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns, table=h.hexdigest())

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no string general.architecture")
        return arch

    def close(self) -> None:
        self._mapping.mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")
