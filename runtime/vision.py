"""Images through a vision tower (vLLM v1's encoder runner and encoder cache): each request's
images (`request.Media`) are encoded before the step that first computes their rows, those
of one preprocessed size together in one graph; the rows are kept in a bounded LRU keyed by
the image's identity (decoded pixels, preprocessing, mmproj), so the same image asked about
again is encoded once."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from hearthlm.core import array_ops
from hearthlm.runtime.dispatch import execute
from hearthlm.runtime.graph_cache import GraphCache
from hearthlm.runtime.placement import Placement

MAX_IMAGES_PER_GRAPH = 8  # images of one size encoded in one graph at most (its scratch grows with them)


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


class VisionEncoder:
    def __init__(self, tower: Any, placement: Placement, *, cache_bytes: int = 256 << 20,
                 fusion: bool | None = None) -> None:
        """`tower` provides build_graph(ImageBatch) -> Graph (input "pixels", output the rows) and
        inputs(pixels (B, 3, H, W)) -> the graph's other inputs; it runs on `placement`."""
        self.tower = tower
        self.graphs = GraphCache(tower.build_graph, placement, fusion_on=fusion, max_graphs=4)
        # a host backend's threads (all of them for an encode, whatever the last step's tuner chose)
        self._host = next((b for b in placement.backends.values() if b.thread_counts()), None)
        self.cache = EncoderCache(cache_bytes)
        self.images_encoded = 0
        self.encode_time_s = 0.0

    def fill(self, media: list) -> None:
        """Give each of `media` (request.Media without rows) its rows: from the cache, or encoded
        (those of one size together)."""
        todo: dict[tuple, list] = {}
        for m in media:
            if m.rows is None:
                m.rows = self.cache.get(m.key)
            if m.rows is None:
                todo.setdefault(m.pixels.shape, []).append(m)
        for group in todo.values():
            seen: dict[bytes, Any] = {}
            for m in group:  # the same image twice in one step is encoded once
                seen.setdefault(m.key, m)
            uniq = list(seen.values())
            for i in range(0, len(uniq), MAX_IMAGES_PER_GRAPH):
                self._encode(uniq[i:i + MAX_IMAGES_PER_GRAPH])
            for m in group:
                m.rows = seen[m.key].rows

    def _encode(self, batch: list) -> None:
        t0 = time.perf_counter()
        pixels = np.stack([m.pixels for m in batch]).astype(np.float32, copy=False)  # (B, 3, H, W)
        cg = self.graphs.get(ImageBatch(len(batch), pixels.shape[2], pixels.shape[3]))
        n_threads = max(self._host.thread_counts()) if self._host is not None else 1
        if self._host is not None:
            self._host.use_threads(n_threads)
        with array_ops.using_host_threads(n_threads):  # attention's heads over the same threads
            rows = execute(cg, {"pixels": pixels, **self.tower.inputs(pixels)}, _no_cache)[0]
        per = rows.reshape(len(batch), -1, rows.shape[-1])
        for m, r in zip(batch, per):
            if r.shape[0] != m.n:
                raise AssertionError(f"the tower gave {r.shape[0]} rows for an image of {m.n}")
            m.rows = np.ascontiguousarray(r)
            self.cache.put(m.key, m.rows)
        self.images_encoded += len(batch)
        self.encode_time_s += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return dict(images_encoded=self.images_encoded, image_encode_time_s=self.encode_time_s,
                    image_cache_bytes=self.cache.nbytes, image_cache_hits=self.cache.hits,
                    image_cache_misses=self.cache.misses)


def _no_cache(node):
    raise AssertionError(f"a vision tower reads no cache ({node.label})")
