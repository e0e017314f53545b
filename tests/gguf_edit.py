"""A copy of a GGUF file with one string of its metadata replaced (a chat template, say): the
header is rewritten, the tensor data copied as it is (its offsets are relative to its start)."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import gguf


def copy_with_string(src: Path, dst: Path, key: str, value: str) -> Path:
    r = gguf.GGUFReader(str(src))
    f = r.fields[key]
    assert f.types == [gguf.GGUFValueType.STRING], f"{key} is not a string"
    start, old_len = f.offset, sum(p.nbytes for p in f.parts)
    k, v = key.encode(), value.encode()
    entry = struct.pack("<Q", len(k)) + k + struct.pack("<I", gguf.GGUFValueType.STRING) + struct.pack("<Q", len(v)) + v
    last = r.tensors[-1].field
    infos_end = last.offset + sum(p.nbytes for p in last.parts)
    align = int(r.fields["general.alignment"].parts[-1][0]) if "general.alignment" in r.fields else 32
    with open(src, "rb") as fin, open(dst, "wb") as out:
        head = fin.read(infos_end)
        out.write(head[:start] + entry + head[start + old_len:])
        out.write(b"\0" * (-out.tell() % align))
        fin.seek(r.data_offset)
        shutil.copyfileobj(fin, out, 16 << 20)
    return dst
