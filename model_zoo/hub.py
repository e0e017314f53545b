"""Hub downloads people can watch and resume: `download` (a progress bar or callback, and a
partial file kept across runs), a callback that logs, and what is on disk (the zoo, the Hub
cache) for `hearthlm models`. resolve.hub_files picks the files."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# progress(filename, bytes done, total bytes or None)
Progress = Callable[[str, int, "int | None"], None]


RETRIES = 5  # connections cut mid-file, continued in the same call before giving up


def download(repo: str, filename: str, *, revision: str | None, cache_dir: Path,
             progress: Progress | None = None) -> Path:
    """One file into the Hub cache's own layout (blobs/<etag>, snapshots/<commit>/<file>,
    refs/<revision>), so huggingface_hub finds it offline later. The blob grows in
    `<etag>.part`, which outlives an interrupted run: the next one continues it with a Range
    request (huggingface_hub 2.x deletes its partial files). progress None: a progress bar."""
    import httpx
    from filelock import FileLock
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    from tqdm.auto import tqdm  # here, not at import: 40 ms of every start that never downloads

    meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision))
    repo_dir = cache_dir / ("models--" + repo.replace("/", "--"))
    blob = repo_dir / "blobs" / meta.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(blob.name + ".part")
    with FileLock(str(part) + ".lock"):  # two processes never append to one part
        if not blob.exists():
            done = part.stat().st_size if part.exists() else 0
            bar = tqdm(total=meta.size, initial=done, unit="B", unit_scale=True, desc=filename) if progress is None else None
            tell = progress or (lambda name, n, total: bar.update(n - bar.n))
            tell(filename, done, meta.size)
            for attempt in range(RETRIES + 1):
                try:
                    done = _fetch(httpx, meta.location, part, done, build_hf_headers(), filename, meta.size, tell)
                    break
                except (httpx.TransportError, OSError):
                    if attempt == RETRIES:
                        raise
                    done = part.stat().st_size if part.exists() else 0
            if bar is not None:
                bar.close()
            if meta.size is not None and done != meta.size:
                raise OSError(f"{filename}: {done} bytes came of {meta.size}; run again to continue")
            os.replace(part, blob)
    link = repo_dir / "snapshots" / meta.commit_hash / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo_dir / "refs" / (revision or "main")
    if revision != meta.commit_hash:  # a branch or tag names the commit it pointed to
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(meta.commit_hash)
    return link


def _fetch(httpx, url: str, part: Path, done: int, headers: dict, name: str, total: int | None, tell) -> int:
    """Append the rest of the file from byte `done`; returns the bytes now in `part`."""
    if done:
        headers = {**headers, "Range": f"bytes={done}-"}
    with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=30) as r:
        if r.status_code == 416 and total == done:  # nothing left to send
            return done
        r.raise_for_status()
        if r.status_code == 200:  # the server ignored the Range: start over
            done = 0
        with open(part, "r+b" if part.exists() else "wb") as f:
            f.seek(done)
            f.truncate()
            for chunk in r.iter_raw():  # as received: a cut loses nothing already written
                f.write(chunk)
                done += len(chunk)
                tell(name, done, total)
    return done


def log_progress(log, every: float = 0.1) -> Progress:
    """A Progress that logs a download's start (a warning: a first use can take minutes, and
    the default level shows it), then each `every` of the file at info level."""
    seen: dict[str, float] = {}

    def cb(name: str, done: int, total: int | None) -> None:
        frac = done / total if total else 0.0
        mb = dict(file=name, mb=round(done / 2**20, 1), of_mb=round(total / 2**20, 1) if total else None)
        finished = bool(total) and done >= total
        if name not in seen:
            log.warning("downloading from the Hub", **mb)
        elif frac < seen[name] + every and not (finished and seen[name] < 1.0):
            return
        seen[name] = frac
        log.info("downloading", pct=round(100 * frac), **mb)
    return cb


def cache_dir() -> Path:
    """Where hearthlm keeps files it makes (assembled models): $HEARTHLM_CACHE or ~/.cache/hearthlm."""
    root = os.environ.get("HEARTHLM_CACHE") or Path.home() / ".cache" / "hearthlm"
    return Path(root).expanduser() / "models"


def hub_cache_dir() -> Path:
    # Read at call time: huggingface_hub reads HF_HUB_CACHE once, at import.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


@dataclass
class CachedFile:
    repo: str        # Hub repo, or "" for hearthlm's own cache
    path: Path
    size: int        # bytes on disk
    revision: str    # the snapshot's commit ("" outside the Hub cache)


def cached_ggufs() -> list[CachedFile]:
    """The .gguf files in the Hub cache and in hearthlm's cache (assembled zoo models)."""
    from huggingface_hub import scan_cache_dir

    out = []
    cache = hub_cache_dir()
    if cache.is_dir():
        for repo in scan_cache_dir(cache).repos:
            for rev in repo.revisions:
                for f in rev.files:
                    if f.file_name.lower().endswith(".gguf"):
                        out.append(CachedFile(repo.repo_id, f.file_path, f.size_on_disk, rev.commit_hash))
    own = cache_dir()
    if own.is_dir():
        out += [CachedFile("", p, p.stat().st_size, "") for p in sorted(own.glob("*.gguf"))]
    return out
