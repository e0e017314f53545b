"""The weights' lifecycle past the file: prepared once per backend (`WeightStore`: packed,
uploaded), or mapped from the packed-weight cache on disk (`weight_cache.WeightCache`, for
backends that export their prepared weights). The records themselves are core.weights."""
from __future__ import annotations

from typing import Any, Callable

from hearthlm.core.log import get_logger
from hearthlm.core.weights import QWeight, RowTable

log = get_logger("hearthlm.weights")


def _exports(backend) -> bool:
    """Whether the backend's prepared weights can go to disk and back: it names a layout, and
    the class that prepares weights also imports them (a subclass that changes prepare_weight
    alone would get its parent's imports back)."""
    owner = lambda attr: next(k for k in type(backend).__mro__ if attr in vars(k))  # noqa: E731
    return bool(backend.weight_layout) and owner("prepare_weight") is owner("import_weight")


class WeightStore:
    """Prepared (packed/uploaded) weights of one backend, each made once, on first use: the
    graph cache binds weights when it compiles a graph, so the engine's load-time compile of
    the decode graph packs what decoding reads. With a `cache` (weight_cache.WeightCache) and
    a backend that exports its weights, those found in the cache file are mapped from it, and
    `persist` writes the file when some had to be prepared afresh."""

    def __init__(self, backend, cache=None) -> None:
        self.backend = backend
        self.cache = cache if cache is not None and _exports(backend) else None
        self._prepared: dict[str, Any] = {}
        self._weights: dict[str, QWeight] = {}
        self._fresh = 0  # weights prepared from the model file, not mapped from the cache
        self._mapped, self.cache_state = self.cache.load(backend) if self.cache else ({}, "off")
        if self.cache_state in ("stale", "corrupt"):  # rebuilt by persist
            log.info("weight_cache_rebuild", state=self.cache_state, problem=self.cache.problem)

    def get(self, w: QWeight) -> Any:
        p = self._prepared.get(w.name)
        if p is None:
            hit = None if isinstance(w, RowTable) else self._mapped.get(w.name)  # not an older cache's packed copy
            if hit is not None and hit[0].get("_type") == int(w.ggml_type) and tuple(hit[0].get("_shape")) == w.shape:
                p = self.backend.import_weight(hit[0], hit[1])
            else:
                p = self.backend.prepare_weight(w)
                if self.cache is not None and self.backend.export_weight(p) is not None:
                    self._fresh += 1  # one the file should hold (not a view of the model file)
            self._prepared[w.name], self._weights[w.name] = p, w
        return p

    def forget(self, names: Callable[[str], bool]) -> None:
        """Drop the prepared weights whose names `names` picks (prepared again if read again)."""
        for n in [n for n in self._prepared if names(n)]:
            del self._prepared[n], self._weights[n]

    def persist(self) -> bool:
        """Write the cache file if weights were prepared afresh, then serve every weight from
        it (the packed copies in memory go; the file is read or mapped: weight_cache). True
        when the prepared values changed: graphs bound to the old ones must rebind."""
        if self.cache is None or not self._fresh:
            return False
        entries = {}
        for name, p in self._prepared.items():
            e = self.backend.export_weight(p)
            if e is not None:
                w = self._weights[name]
                entries[name] = (dict(e[0], _type=int(w.ggml_type), _shape=list(w.shape)), e[1])
        self._fresh = 0
        if not self.cache.save(self.backend, entries):
            log.warning("weight_cache_unwritable", problem=self.cache.problem)
            self.cache_state = "unwritable"
            return False
        self._mapped, state = self.cache.load(self.backend)
        if state != "hit":
            return False
        self.cache_state = "written"
        self._prepared = {n: p for n, p in self._prepared.items() if n not in self._mapped}
        return True

    def __len__(self) -> int:
        return len(self._prepared)
