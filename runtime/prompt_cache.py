"""Persisted prompt prefixes: the KV blocks of a prompt's full blocks (and, for a hybrid model,
its recurrent state at their end) in a file, so that a later process whose prompt begins with
those tokens maps them instead of computing them (llama-server's slot save/restore, mlx-lm's
save_prompt_cache). runtime.seq_memory saves and loads them; this module keeps the files.

A file is named by the model's key (file identity, KV types and shapes, block size) and the
digest of its tokens; its index holds the digest after each block, so a prompt that shares
only the first blocks of a file (a system prompt, then another question) takes those blocks.
A hybrid model's state is known only at the file's end: there the match must be whole.
Corrupt, stale or vanished files are ignored (and removed); the directory is bounded in bytes,
least recently used first; a directory that cannot be written means no new files."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hearthlm.core.log import get_logger
from hearthlm.runtime import array_file

log = get_logger("hearthlm.prompt_cache")
MAGIC = b"HLPCACHE"
FORMAT = 1
SUFFIX = ".hlp"


def digests(tokens: Sequence[int], block_size: int, n_blocks: int) -> list[str]:
    """The digest of the tokens up to the end of each of the first n_blocks blocks."""
    h, out = hashlib.sha256(), []
    for i in range(n_blocks):
        h.update(np.asarray(tokens[i * block_size:(i + 1) * block_size], "<i4").tobytes())
        out.append(h.copy().hexdigest()[:32])
    return out


class PromptCache:
    def __init__(self, directory: Path, key: dict[str, Any], *, block_size: int, hybrid: bool,
                 max_bytes: int = 1 << 30) -> None:
        self.directory, self.block_size = Path(directory), block_size
        self.key = json.loads(json.dumps(key, sort_keys=True))  # as the files hold it
        self.hybrid, self.max_bytes = hybrid, max_bytes
        self.tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self._index: dict[str, tuple[Path, int]] = {}  # digest -> (file, blocks of it up to there)
        self._seen: int | None = None  # the directory's mtime when last scanned
        self.problem: str | None = None  # why the last save or load did not happen
        self.counters = dict(prompt_cache_loaded_tokens=0, prompt_cache_files_written=0)

    # ---- lookup ---------------------------------------------------------------------------
    def longest(self, ds: list[str]) -> tuple[Path, int] | None:
        """The file holding the most of these leading blocks (by their digests), and how many."""
        self._rescan()
        for d in reversed(ds):
            hit = self._index.get(d)
            if hit is not None:
                return hit
        return None

    def _rescan(self) -> None:
        """Index the model's files when the directory changed (another process wrote one)."""
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            self._index, self._seen = {}, None
            return
        if mtime == self._seen:
            return
        self._seen, self._index = mtime, {}
        sized = []
        for p in self.directory.glob(f"{self.tag}-*{SUFFIX}"):
            try:
                sized.append((-p.stat().st_size, p))
            except OSError:  # gone meanwhile
                pass
        for _, path in sorted(sized):  # bigger files first: a digest maps to the longest
            try:
                index, _ = array_file.read(path, MAGIC, FORMAT, arrays=False)
                if index.get("key") != self.key:  # renamed or copied from another model's
                    raise array_file.ArrayFileError("stale", "made for another model or layout")
                ds = index["digests"]
            except (OSError, array_file.ArrayFileError, KeyError, TypeError) as e:
                self.discard(path, f"unusable: {e}")
                continue
            for i, d in enumerate(ds[-1:] if self.hybrid else ds):
                self._index.setdefault(d, (path, len(ds) if self.hybrid else i + 1))

    def load(self, path: Path, n_blocks: int) -> dict[str, np.ndarray] | None:
        """The file's arrays: per layer "k{il}"/"v{il}" (n_tokens, h, d), and for a hybrid model
        "{name}/{il}" states; None (the file dropped) when it cannot be used."""
        try:
            index, arrays = array_file.read(path, MAGIC, FORMAT)
            if index.get("key") != self.key or len(index["digests"]) < n_blocks:
                raise array_file.ArrayFileError("stale", "made for another model or layout")
        except FileNotFoundError:  # another process evicted it
            self._forget(path)
            return None
        except (OSError, array_file.ArrayFileError, KeyError, TypeError) as e:
            self.discard(path, str(e))
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        self.counters["prompt_cache_loaded_tokens"] += n_blocks * self.block_size
        # q8_0 blocks were int8 arrays before core.kv_types (all blocks are bytes now): the key
        # says which type they are, the bytes are the same
        return {k: a.view(np.uint8) if a.dtype == np.int8 else a for k, a in arrays.items()}

    # ---- saving ---------------------------------------------------------------------------
    def save(self, tokens: Sequence[int], arrays: dict[str, np.ndarray]) -> bool:
        """Persist the KV (and state) of `tokens`, a whole number of blocks; False if it cannot."""
        n = len(tokens) // self.block_size
        ds = digests(tokens, self.block_size, n)
        path = self.directory / f"{self.tag}-{ds[-1]}{SUFFIX}"
        if path.exists():
            try:
                os.utime(path)
                return True
            except OSError:
                pass
        try:
            array_file.write(path, MAGIC, FORMAT, dict(key=self.key, digests=ds, n_tokens=len(tokens)), arrays)
        except OSError as e:
            self.problem = f"{self.directory}: cannot write the prompt cache: {e}"
            log.warning("prompt cache not written", reason=self.problem)
            return False
        self.counters["prompt_cache_files_written"] += 1
        self._evict(keep=path)
        self._seen = None  # index it (and whatever else appeared) at the next lookup
        return True

    def _evict(self, keep: Path) -> None:
        files = []
        for p in self.directory.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
                files.append((st.st_mtime_ns, st.st_size, p))
            except OSError:
                pass
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):  # oldest use first
            if total <= self.max_bytes:
                break
            if p != keep:
                self._forget(p, unlink=True)
                total -= size

    def stats(self) -> dict[str, Any]:
        files = list(self.directory.glob(f"{self.tag}-*{SUFFIX}")) if self.directory.is_dir() else []
        return dict(self.counters, prompt_cache_files=len(files),
                    prompt_cache_bytes=sum(p.stat().st_size for p in files if p.exists()))

    def discard(self, path: Path, why: str) -> None:
        self.problem = f"{path}: {why}"
        log.warning("prompt cache file ignored", reason=self.problem)
        self._forget(path, unlink=True)

    def _forget(self, path: Path, unlink: bool = False) -> None:
        self._index = {d: hit for d, hit in self._index.items() if hit[0] != path}
        if unlink:
            try:
                path.unlink()
            except OSError:
                pass
