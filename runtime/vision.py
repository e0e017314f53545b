"""Images through a vision tower (vLLM v1's encoder runner and encoder cache): each request's
images (`request.Media`) are queued (`want`), those of one preprocessed size together in one
graph, which `advance` runs in turns (runtime.vision_walk: stopped between kernels, a big one in
blocks of rows) of the time the engine's share of a step allows, so that decoding streams keep
their pace beside a client sending images, and whole when nothing else runs; the rows are kept in
a bounded LRU keyed by the image's identity (decoded pixels, preprocessing, mmproj), so the same
image asked about again is encoded once."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from hearthlm.core import array_ops
from hearthlm.runtime.graph_cache import GraphCache
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.vision_walk import RATE_GUESS, ROW_SOURCES, Walk

MAX_IMAGES_PER_GRAPH = 8  # images of one size encoded in one graph at most (its scratch grows with them)
SLICE_S = 0.05  # beside other work, a turn of the tower runs about this long
SHARE_AFTER = 2.0  # ... once the other work has run this many times as long since the last turn (decoding: 2/3)
ALONE_TURN_S = 1.0  # with nothing else to do, turns this long: kernels whole, and news (an abort, a request) heard


@dataclass(frozen=True)
class ImageBatch:
    """The shape a tower's graph is built and cached for: images of one preprocessed size."""
    n_images: int
    height: int
    width: int


class EncoderCache:
    """Image rows by identity, least recently used dropped past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, key: bytes) -> np.ndarray | None:
        rows = self._rows.get(key)
        if rows is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: bytes, rows: np.ndarray) -> None:
        if key in self._rows or rows.nbytes > self.max_bytes:
            return
        self._rows[key] = rows
        self.nbytes += rows.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self.nbytes -= old.nbytes


@dataclass(eq=False)
class _Job:
    """Images of one size encoded together: the tower's graph run part way (`walk`, made at its first turn)."""
    media: dict[bytes, list]  # image key -> the Media waiting for its rows
    pixels: np.ndarray        # (B, 3, H, W)
    walk: Walk | None = None


class VisionEncoder:
    def __init__(self, tower: Any, placement: Placement, *, cache_bytes: int = 256 << 20,
                 fusion: bool | None = None, slice_s: float = SLICE_S) -> None:
        """`tower` provides build_graph(ImageBatch) -> Graph (input "pixels"; output the rows, then any
        columns to append to them), inputs(pixels (B, 3, H, W)) -> the graph's other inputs, and
        config.n_layer; it runs on `placement`. Beside other work the graph runs in turns of about
        `slice_s` seconds (a big product in blocks of rows; 0: a block or a small kernel a turn)."""
        self.tower, self.n_layer = tower, tower.config.n_layer
        self.graphs = GraphCache(tower.build_graph, placement, fusion_on=fusion, max_graphs=64)
        # a host backend's threads (all of them for an encode, whatever the last step's tuner chose)
        self._host = next((b for b in placement.backends.values() if b.thread_counts()), None)
        self.cache = EncoderCache(cache_bytes)
        self.slice_s = slice_s
        self._jobs: list[_Job] = []
        self._rate = {op: RATE_GUESS for op in ROW_SOURCES}  # FLOP/s each row-split op kind last ran at
        self.images_encoded = 0
        self.encode_time_s = 0.0
        self.last_turn_s = 0.0  # the last turn beside other work (the engine's share of time follows it)
        self.longest_turn_s = 0.0  # the longest turn beside other work (what decoding streams wait at most)

    def want(self, media: list) -> None:
        """Queue the encoding of `media` (request.Media) that have no rows: rows from the cache at
        once where it holds them; an image already queued is not queued twice."""
        queued = {k: j for j in self._jobs for k in j.media}
        new: dict[tuple, dict[bytes, list]] = {}
        for m in media:
            if m.rows is None:
                m.rows = self.cache.get(m.key)
            if m.rows is not None:
                continue
            if m.key in queued:
                queued[m.key].media[m.key].append(m)
            else:
                new.setdefault(m.pixels.shape, {}).setdefault(m.key, []).append(m)
        for group in new.values():
            keys = list(group)
            for i in range(0, len(keys), MAX_IMAGES_PER_GRAPH):
                part = {k: group[k] for k in keys[i:i + MAX_IMAGES_PER_GRAPH]}
                pixels = np.stack([ms[0].pixels for ms in part.values()]).astype(np.float32, copy=False)
                self._jobs.append(_Job(part, pixels))

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def advance(self, budget_s: float | None = None) -> float:
        """Run the queued encodings, oldest first, for about `budget_s` seconds (a kernel or a block of
        rows at least; None: to the end, each kernel whole). Returns the seconds spent."""
        t0, first = time.perf_counter(), True
        while self._jobs:
            left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
            if left is not None and left <= 0 and not first:
                break
            self._run(self._jobs[0], left, first)
            first = False
        return time.perf_counter() - t0

    def take_turn(self, requests: list, running: list, since_s: float) -> bool:
        """The engine's step: queue the images `requests` wait for (forgetting those none waits for
        now: a cancelled request's), then run a turn of the tower where it is theirs. While other
        requests (of `running`) have work, a turn of about slice_s runs only once the forward passes
        since the last turn (`since_s`) have taken SHARE_AFTER times as long as it did, so decoding
        keeps more than half its pace and waits about slice_s at most; with nothing else to do,
        encoding runs in long turns (ALONE_TURN_S: the engine hears of new requests and aborts between
        them) and owes nothing after. Returns whether a turn ran."""
        self.want([m for r in requests for m in r.media if m.rows is None])
        live = {id(m) for r in requests for m in r.media}  # a cancelled request's images are not encoded on
        self._jobs = [j for j in self._jobs if any(id(m) in live for ms in j.media.values() for m in ms)]
        others = any(r.n_wanted > 0 and not _waits_for_image(r) for r in running)
        if not self._jobs or others and since_s < SHARE_AFTER * self.last_turn_s:
            return False
        spent = self.advance(self.slice_s if others else ALONE_TURN_S)
        self.last_turn_s = spent if others else 0.0
        self.longest_turn_s = max(self.longest_turn_s, self.last_turn_s)
        return True

    def drop_all(self, requests: list) -> list:
        """Forget the queued encodings (after a failure); the requests of `requests` that waited on them."""
        self._jobs.clear()
        return [r for r in requests if any(m.rows is None for m in r.media)]

    @classmethod
    def beside(cls, tower: Any, placement: Placement, cache_bytes: int, fusion: bool | None) -> "VisionEncoder":
        """The encoder of a model placed by `placement`: on the backend of its output head."""
        return cls(tower, Placement.single(placement.backends[placement.output], tower.config.n_layer),
                   cache_bytes=cache_bytes, fusion=fusion)

    def fill(self, media: list) -> None:
        """Give each of `media` its rows now (cached, or encoded to the end)."""
        self.want(media)
        while any(m.rows is None for m in media):
            self._run(self._jobs[0], None)

    def _run(self, job: _Job, budget_s: float | None, first: bool = True) -> None:
        """`job`'s tower for about budget_s seconds (None: to the end), then its rows where it ended."""
        t0 = time.perf_counter()
        b, _, h, w = job.pixels.shape
        if job.walk is None:  # the tower's own inputs (positions, a resized table) once per job
            cg = self.graphs.get(ImageBatch(b, h, w))
            job.walk = Walk(cg, {"pixels": job.pixels, **self.tower.inputs(job.pixels)}, self.graphs.placement)
        n_threads = max(self._host.thread_counts()) if self._host is not None else 1
        if self._host is not None:
            self._host.use_threads(n_threads)
        with array_ops.using_host_threads(n_threads):  # attention's blocks over the same threads
            outs = job.walk.run(budget_s, self._rate, first)
        dt = time.perf_counter() - t0
        self.encode_time_s += dt
        if outs is None:
            return
        self._jobs.remove(job)
        out, *columns = outs
        if columns:  # the rows, then what earlier layers computed for them (Qwen3-VL's deepstack)
            out = np.concatenate([out, *columns], axis=1)
        per = out.reshape(b, -1, out.shape[-1])
        for (key, ms), rows in zip(job.media.items(), per):
            if rows.shape[0] != ms[0].n:
                raise AssertionError(f"the tower gave {rows.shape[0]} rows for an image of {ms[0].n}")
            rows = np.ascontiguousarray(rows)
            self.cache.put(key, rows)
            for m in ms:
                m.rows, m.pixels = rows, None  # the pixels are not needed again (a recomputation reads the rows)
        self.images_encoded += b

    def stats(self) -> dict[str, Any]:
        return dict(images_encoded=self.images_encoded, image_encode_time_s=self.encode_time_s,
                    image_cache_bytes=self.cache.nbytes, image_cache_hits=self.cache.hits,
                    image_cache_misses=self.cache.misses, images_queued=sum(len(j.media) for j in self._jobs),
                    image_longest_turn_s=self.longest_turn_s)


def _waits_for_image(r) -> bool:
    """The request's next token is an image's whose rows are not encoded yet."""
    return any(m.rows is None and m.start <= r.n_computed < m.end for m in r.media)


