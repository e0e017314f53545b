"""Images through a vision tower (vLLM v1's encoder runner and encoder cache): each request's
images (`request.Media`) are queued (`want`), those of one preprocessed size together in one
graph, and encoded a stage (a few layers) at a time by `advance`, which the engine calls with
the time its share of a step allows, so that decoding streams keep their pace beside a client
sending images; the rows are kept in a bounded LRU keyed by the image's identity (decoded
pixels, preprocessing, mmproj), so the same image asked about again is encoded once."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hearthlm.core import array_ops
from hearthlm.runtime.dispatch import execute
from hearthlm.runtime.graph_cache import GraphCache
from hearthlm.runtime.placement import Placement

MAX_IMAGES_PER_GRAPH = 8  # images of one size encoded in one graph at most (its scratch grows with them)
SLICE_S = 0.05  # a stage of the tower runs about this long (whole layers; at least one)


@dataclass(frozen=True)
class ImageBatch:
    """The shape a tower's graph is built and cached for: images of one preprocessed size, and the
    stage of the tower (layers lo..hi; hi -1: to the end, then the projector)."""
    n_images: int
    height: int
    width: int
    lo: int = 0
    hi: int = -1


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
    """Images of one size encoded together, a stage at a time: `x` the last stage's output."""
    media: dict[bytes, list]  # image key -> the Media waiting for its rows
    pixels: np.ndarray        # (B, 3, H, W)
    x: np.ndarray | None = None
    layer: int = 0            # the next stage starts at this layer
    feed: dict | None = None  # the graph's inputs but "x", made at its first stage
    columns: list = field(default_factory=list)  # the stages' further outputs: columns appended to the rows


class VisionEncoder:
    def __init__(self, tower: Any, placement: Placement, *, cache_bytes: int = 256 << 20,
                 fusion: bool | None = None, slice_s: float = SLICE_S) -> None:
        """`tower` provides build_graph(ImageBatch) -> Graph (input "pixels", or a stage's "x";
        output the rows, or the stage's activations, then any columns to append to the rows),
        inputs(pixels (B, 3, H, W)) -> the graph's other inputs, and config.n_layer; it runs on
        `placement`."""
        self.tower, self.n_layer = tower, tower.config.n_layer
        self.graphs = GraphCache(tower.build_graph, placement, fusion_on=fusion, max_graphs=64)
        # a host backend's threads (all of them for an encode, whatever the last step's tuner chose)
        self._host = next((b for b in placement.backends.values() if b.thread_counts()), None)
        self.cache = EncoderCache(cache_bytes)
        self.slice_s = slice_s
        self._jobs: list[_Job] = []
        self._layer_s: dict[tuple, float] = {}  # seconds a layer takes, per image batch shape
        self.images_encoded = 0
        self.encode_time_s = 0.0
        self.last_stage_s = 0.0  # how long the last stage took (the engine's share of time follows it)

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
        """Run stages of the queued encodings, oldest first, until `budget_s` seconds are spent
        (at least one stage; None: until none is left). Returns the seconds spent."""
        t0 = time.perf_counter()
        while self._jobs:
            self._stage(self._jobs[0])
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                break
        return time.perf_counter() - t0

    def take_turn(self, requests: list, running: list, since_s: float) -> float:
        """The engine's step: queue the images `requests` wait for, then run a stage where it is
        their turn. While other requests (of `running`) have work, a stage runs only once the
        steps since the last one (`since_s`) have taken as long as it did, so decoding keeps at
        least half its pace; with nothing else to do, encoding runs to the end. Returns the
        seconds spent, or minus since_s where nothing ran (so the engine's count goes on)."""
        self.want([m for r in requests for m in r.media if m.rows is None])
        others = any(r.n_wanted > 0 and not _waits_for_image(r) for r in running)
        if not self._jobs or others and since_s < self.last_stage_s:
            return -since_s
        return self.advance(0.0 if others else None)

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
            self._stage(self._jobs[0])

    def _stage(self, job: _Job) -> None:
        """The next few layers of `job` (about slice_s seconds' worth), or its last stage."""
        t0 = time.perf_counter()
        b, _, h, w = job.pixels.shape
        per_layer = self._layer_s.get((b, h, w))
        n = self.n_layer if per_layer is None and job.layer else 1 if per_layer is None else \
            max(1, int(self.slice_s / per_layer))
        hi = min(job.layer + n, self.n_layer)
        cg = self.graphs.get(ImageBatch(b, h, w, job.layer, -1 if hi == self.n_layer else hi))
        if job.feed is None:  # the tower's own inputs (positions, a resized table) once per job
            job.feed = {"pixels": job.pixels, **self.tower.inputs(job.pixels)}
        feed = dict(job.feed)
        if job.x is not None:
            feed["x"] = job.x
        n_threads = max(self._host.thread_counts()) if self._host is not None else 1
        if self._host is not None:
            self._host.use_threads(n_threads)
        with array_ops.using_host_threads(n_threads):  # attention's blocks over the same threads
            out, *columns = execute(cg, feed, _no_cache)
        job.columns += columns
        dt = self.last_stage_s = time.perf_counter() - t0
        if job.layer == 0 and hi < self.n_layer:  # the first stage times a layer (its patch embedding too)
            self._layer_s[(b, h, w)] = dt / (hi - job.layer)
        job.x, job.layer = out, hi
        self.encode_time_s += dt
        if hi < self.n_layer:
            return
        self._jobs.remove(job)
        if job.columns:  # the rows, then what earlier layers computed for them (Qwen3-VL's deepstack)
            out = np.concatenate([out, *job.columns], axis=1)
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
                    image_cache_misses=self.cache.misses, images_queued=sum(len(j.media) for j in self._jobs))


def _waits_for_image(r) -> bool:
    """The request's next token is an image's whose rows are not encoded yet."""
    return any(m.rows is None and m.start <= r.n_computed < m.end for m in r.media)


def _no_cache(node):
    raise AssertionError(f"a vision tower reads no cache ({node.label})")
