"""Placement: which backend runs each graph node, and the graph split into runs of nodes on
one backend with copies between them (ggml's sched). Layers go as llama.cpp's `-ngl`: the
last n_gpu_layers layers and the output head on the GPU, the rest and the token embeddings
on the host (the first backend, a CPU one). `place` runs once per cached graph, after fusion:
1. assign: weights by their layer (`blk.{il}.` in the GGUF name; an embedding table read
   only by GET_ROWS on the host, other unlayered weights with the output head), caches by
   layer; a compute node with the weights it uses, else its layer, else its first source;
   where that backend does not support the node, on the host;
2. split: a source on another backend reaches the node through one COPY per (tensor,
   destination), placed before its first consumer there; leaves are not copied: each
   backend that reads an input uploads it, and each that reads a weight prepares its own;
3. count: splits (runs of compute nodes on one backend) and copies, for tests and dumps."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping

from hearthlm.core.backend import Backend
from hearthlm.core.errors import BackendError
from hearthlm.core.graph import Graph, Op, Tensor
from hearthlm.core.log import get_logger

log = get_logger("hearthlm.placement")
_BLK = re.compile(r"blk\.(\d+)\.")


class Placement:
    """Backends by name (the first is the host: embeddings, inputs, fallbacks) and, per
    layer, the name of the backend holding its weights and K/V cache."""

    def __init__(self, backends: Mapping[str, Backend], layers: list[str]) -> None:
        self.backends: dict[str, Backend] = dict(backends)
        self.layers = list(layers)
        self.host = next(iter(self.backends))
        unknown = set(self.layers) - set(self.backends)
        if unknown:
            raise BackendError(f"layers placed on unknown backends {sorted(unknown)}; have {list(self.backends)}")

    @classmethod
    def single(cls, backend: Backend, n_layer: int) -> "Placement":
        """One backend running everything."""
        return cls({backend.name: backend}, [backend.name] * n_layer)

    @property
    def output(self) -> str:
        """The output head goes with the last layer (no copy of the residual back)."""
        return self.layers[-1] if self.layers else self.host

    def of_layer(self, il: int) -> str:
        return self.layers[il] if 0 <= il < len(self.layers) else self.output

    def layer_backends(self) -> list[Backend]:
        return [self.backends[b] for b in self.layers]

    @property
    def key(self) -> str:
        """What the graph cache tells placements apart by, e.g. "cpu:0-14|cuda:15-29", or
        "cpu" for one backend."""
        if len(self.backends) == 1:
            return self.host
        runs: list[list] = []
        for il, b in enumerate(self.layers):
            if runs and runs[-1][0] == b:
                runs[-1][2] = il
            else:
                runs.append([b, il, il])
        parts = [f"{b}:{a}-{z}" for b, a, z in runs]
        if not runs or runs[0][0] != self.host:
            parts.insert(0, f"{self.host}:embd")
        return "|".join(parts)

    def __repr__(self) -> str:
        return f"Placement({self.key})"


def offload(backends: Mapping[str, Backend], n_layer: int, n_gpu_layers: int | None) -> Placement:
    """llama.cpp's -ngl over (host, device): the last n_gpu_layers layers (None: all; more
    than n_layer: all) and the output head on the device. One backend, or none offloaded:
    the host backend alone."""
    names = list(backends)
    k = n_layer if n_gpu_layers is None else min(n_gpu_layers, n_layer)
    if len(names) == 1 or k <= 0:
        return Placement.single(backends[names[0]], n_layer)
    host, dev = names[0], names[1]
    return Placement({host: backends[host], dev: backends[dev]}, [host] * (n_layer - k) + [dev] * k)


# ---- the passes ---------------------------------------------------------------------------

def assign(graph: Graph, p: Placement) -> list[str]:
    """1. The backend name of each node, in node order."""
    table_only: dict[int, bool] = {}  # id(weight) -> read only as a GET_ROWS table (token embeddings)
    for n in graph.nodes:
        for j, s in enumerate(n.srcs):
            if s.op is Op.WEIGHT:
                table_only[id(s)] = table_only.get(id(s), True) and n.op is Op.GET_ROWS and j == 0
    where: dict[int, str] = {}
    for n in graph.nodes:
        if n.op is Op.INPUT:
            b = p.host  # host data; split() gives each other backend reading it its own upload
        elif n.op is Op.WEIGHT:
            m = _BLK.match(n.name)
            b = p.of_layer(int(m.group(1))) if m else p.host if table_only.get(id(n)) else p.output
        elif n.op is Op.CACHE:
            b = p.of_layer(n.layer)
        elif n.op.props.writes_cache or n.op.props.updates_state:
            where[id(n)] = where[id(n.srcs[0])]  # a copy of the cache would take the write: no fallback
            continue
        else:
            w = next((s for s in n.srcs if s.op is Op.WEIGHT), None)
            b = (where[id(w)] if w is not None else p.of_layer(n.layer) if n.layer >= 0
                 else where[id(n.srcs[0])] if n.srcs else p.host)
        where[id(n)] = b if p.backends[b].supports(n) else p.host
    return [where[id(n)] for n in graph.nodes]


@dataclass
class Split:
    graph: Graph          # every node reads sources on its own backend
    backends: list[str]   # per node of graph: the name of the backend that runs it
    n_splits: int         # runs of compute nodes on one backend
    n_copies: int         # COPY nodes between them


def split(graph: Graph, where: list[str]) -> Split:
    """2. and 3. A new graph where every node reads sources on its own backend."""
    out = Graph()
    out.inputs, names = dict(graph.inputs), []
    home: dict[int, str] = {}                     # id(node of out) -> backend
    new: dict[int, Tensor] = {}                   # id(node of graph) -> its node in out
    moved: dict[tuple[int, str], Tensor] = {}     # (id(node of out), backend) -> its copy or leaf there

    def note(t: Tensor, b: str) -> Tensor:
        names.append(b)
        home[id(t)] = b
        return t

    def reach(s: Tensor, b: str) -> Tensor:
        if home[id(s)] == b:
            return s
        t = moved.get((id(s), b))
        if t is None:
            if s.op.props.per_backend:
                out.nodes.append(t := dataclasses.replace(s))
            else:
                t = out.copy(s, src=home[id(s)], dst=b)  # the builder appends it
            moved[(id(s), b)] = note(t, b)
        return t

    for n, b in zip(graph.nodes, where):
        srcs = tuple(reach(new.get(id(s), s), b) for s in n.srcs)
        t = n if srcs == n.srcs else dataclasses.replace(n, srcs=srcs)
        out.nodes.append(t)
        new[id(n)] = note(t, b)
    out.outputs = [new[id(o)] for o in graph.outputs]
    runs = [b for t, b in zip(out.nodes, names) if not t.op.props.bound]
    n_splits = sum(1 for i, b in enumerate(runs) if i == 0 or runs[i - 1] != b)
    return Split(out, names, n_splits, sum(1 for t in out.nodes if t.op.props.moves))


def place(graph: Graph, p: Placement) -> Split:
    s = split(graph, assign(graph, p))
    log.debug("placed", placement=p.key, nodes=len(s.graph.nodes), splits=s.n_splits, copies=s.n_copies)
    return s
