"""One file of named arrays, for hearthlm's caches on disk (packed weights, persisted prompt
prefixes): a fixed head, a JSON index, then each array at a 64-byte aligned offset with a
checksum. Written to a temporary file renamed into place, so a reader sees an old file or a
whole new one; read through a copy-on-write mapping, so the arrays' pages stay the file's, or
(`private`) into anonymous memory that asks for huge pages."""
from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

_HEAD = struct.Struct("<8sIIQQQ")  # magic, format, 0, index bytes, data offset, file bytes
_ALIGN = 64
# 2 MiB pages for data read privately (Linux's transparent huge pages, asked for by madvise):
# a matvec streaming 0.5-3.5 MB of weights misses the TLB every 4 KiB page otherwise, and the
# hardware prefetcher stops at each page's end. Measured on a 2-core Xeon VM, same process pairs:
# a plain read of Qwen2.5-0.5B's weights 19 -> 24 GB/s, 1-token steps of Qwen2.5, Gemma 3 and
# SmolLM2 29.1 -> 25.9-27.6, 19.5 -> 17.8 and 11.5 -> 10.3 ms.
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


# Huge pages that fault in slower than this are given up for the rest of a private read. On a VM
# whose free memory goes back to the host, a fresh 2 MiB page costs the host's faults on all of
# it: measured on a 2-core Firecracker guest, recycled huge pages faulted at ~5 GB/s and fresh
# ones at 0.06-0.08 (486 MB took 0.2 s one time, 7.4 s another; 4 KiB pages: 0.3-0.4 s always).
SLOW_HUGE_PAGES = 500e6  # bytes/s
_HUGE = 2 << 20


def _read_private(f, size: int) -> mmap.mmap:
    """The whole file in private anonymous memory, in huge pages while they come quickly (two
    slow ones in a row, not one: a preemption). Private: mmap(-1, n) alone is a shared mapping,
    i.e. shmem, which THP leaves alone unless shmem_enabled allows it (usually "never")."""
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are made huge as they fault
    pages, slow = np.frombuffer(mm, np.uint8), 0
    for off in range(0, size - _HUGE, _HUGE):  # one byte faults in a whole huge page
        t = time.perf_counter()
        pages[off] = 0
        slow = slow + 1 if _HUGE < SLOW_HUGE_PAGES * (time.perf_counter() - t) else 0
        if slow == 2:
            mm.madvise(mmap.MADV_NOHUGEPAGE, off + _HUGE, size - off - _HUGE)
            break
    del pages  # its export of mm's buffer
    if f.readinto(mm) != size:
        raise ArrayFileError("corrupt", "shorter than it was a moment ago")
    return mm


class ArrayFileError(Exception):
    """A file that cannot be used: `state` is "corrupt" (a check failed) or "stale" (another format)."""

    def __init__(self, state: str, why: str) -> None:
        super().__init__(why)
        self.state = state


def checksum(a: np.ndarray) -> int:
    """A 64-bit wrapping sum of the bytes as little-endian words (regions are padded to 64
    bytes with zeros): at memory speed, where crc32 (~0.9 GB/s) would add 0.1-0.3 s to a start."""
    return int(np.add.reduce(a.view("<u8"), dtype=np.uint64)) if a.size else 0


def read(path: Path, magic: bytes, fmt: int, *, arrays: bool = True,
         private: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """(index, {name: array}); `arrays=False` reads the index only (no checksums); `private`:
    the bytes copied into anonymous memory with huge pages asked for (Linux: HUGE_PAGES), not
    mapped from the file. Raises FileNotFoundError, OSError, or ArrayFileError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEAD.size:
            raise ArrayFileError("corrupt", "shorter than its head")
        try:
            if private and arrays and HUGE_PAGES:
                mm = _read_private(f, size)
            else:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise ArrayFileError("corrupt", f"cannot map: {e}") from None
    got_magic, got_fmt, _, n_index, data_at, n_file = _HEAD.unpack_from(mm, 0)
    if got_magic != magic:
        raise ArrayFileError("corrupt", "bad magic")
    if got_fmt != fmt:
        raise ArrayFileError("stale", f"format {got_fmt}")
    if n_file != size or not _HEAD.size + n_index <= data_at <= size:
        raise ArrayFileError("corrupt", "lengths do not match the file")
    try:
        index = json.loads(bytes(mm[_HEAD.size:_HEAD.size + n_index]))
        extents = index.pop("arrays")
        if not arrays:
            return index, {}
        buf, out = np.frombuffer(mm, np.uint8), {}
        for name, (dtype, shape, rel, nbytes, chk) in extents.items():
            dt, n = np.dtype(dtype), int(np.prod(shape, dtype=np.int64))
            span, off = -(-nbytes // _ALIGN) * _ALIGN, data_at + rel
            if rel % _ALIGN or rel < 0 or off + span > size or n * dt.itemsize != nbytes or dt.hasobject:
                raise ArrayFileError("corrupt", f"{name}: bad extent")
            region = buf[off:off + span]
            if checksum(region) != chk:
                raise ArrayFileError("corrupt", f"{name}: checksum mismatch")
            out[name] = region[:nbytes].view(dt).reshape(shape)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged index
        raise ArrayFileError("corrupt", f"bad index: {type(e).__name__}: {e}") from None
    return index, out


def _padded_checksum(a: np.ndarray) -> int:
    """checksum() of a's bytes zero-padded to 64, without copying a."""
    b = a.reshape(-1).view(np.uint8)
    whole = len(b) // 8 * 8
    tail = np.zeros(8, np.uint8)
    tail[:len(b) - whole] = b[whole:]
    return (checksum(b[:whole]) + checksum(tail)) % (1 << 64)


def write(path: Path, magic: bytes, fmt: int, index: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Write `index` (JSON-able) and `arrays` as one file at `path`, atomically. Raises OSError."""
    index, off, plan = dict(index, arrays={}), 0, []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        span = -(-a.nbytes // _ALIGN) * _ALIGN
        index["arrays"][name] = [a.dtype.str, list(a.shape), off, a.nbytes, _padded_checksum(a)]
        plan.append((a, span))
        off += span
    raw = json.dumps(index, separators=(",", ":")).encode()
    data_at = -(-(_HEAD.size + len(raw)) // mmap.PAGESIZE) * mmap.PAGESIZE  # offsets in the index are from here
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEAD.pack(magic, fmt, 0, len(raw), data_at, data_at + off))
            f.write(raw)
            f.write(b"\0" * (data_at - _HEAD.size - len(raw)))
            for a, span in plan:
                f.write(a.reshape(-1).view(np.uint8).data)
                f.write(b"\0" * (span - a.nbytes))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep it from other users' processes
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
