"""Tiny synthetic llama / gemma3 models (random weights, no file) for graph-level tests:
their configs, weights, a fake Model for the Engine, and a step's feed over a paged cache."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from hearthlm.core.graph import Graph
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.models import gemma3, llama
from hearthlm.model_zoo.tensors import Weights, specs
from hearthlm.runtime.batch import BatchShape

DIMS = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, n_vocab=50)


def metadata(arch: str, n_layer: int, **dims) -> dict:
    """The GGUF hyperparameters of a tiny model, under the architecture's own prefix."""
    d = {**DIMS, **dims}
    md = {"block_count": n_layer, "embedding_length": d["n_embd"], "attention.head_count": d["n_head"],
          "attention.head_count_kv": d["n_head_kv"], "attention.key_length": d["head_dim"],
          "feed_forward_length": d["n_ff"], "context_length": 4096}
    if arch == "gemma3":
        md.update({"rope.freq_base": 1e6, "attention.sliding_window": 5})
    return {f"{arch}.{k}": v for k, v in md.items()}


def config(arch: str, n_layer: int, **dims):
    mod = {"llama": llama, "gemma3": gemma3}[arch]
    return mod, mod.Config.from_gguf(metadata(arch, n_layer, **dims), arch)


def weight_shapes(arch: str, n_layer: int, **dims) -> dict[str, tuple[int, ...]]:
    """What the architecture reads (its own declarations), less the optional tensors."""
    mod, cfg = config(arch, n_layer, **dims)
    return {sp.name: sp.shape for sp in specs(mod, cfg, {**DIMS, **dims}["n_vocab"]) if not sp.optional}


def weights(arch: str, n_layer: int, seed: int = 0, raw: bool = True, **dims) -> dict[str, QWeight]:
    """F32 weights ~ N(0, 1/sqrt(fan_in)); norms ~ 1. raw=False: shapes only (graph tests)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(arch, n_layer, **dims).items():
        if not raw:
            out[name] = QWeight(name, int(T.F32), shape, np.zeros((0,), np.uint8))
            continue
        a = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
             else rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        out[name] = QWeight(name, int(T.F32), shape, a.reshape(shape[0] if len(shape) == 2 else 1, -1).view(np.uint8))
    return out


def build(arch: str, ws: dict[str, QWeight], shape: BatchShape, n_layer: int, **dims) -> Graph:
    mod, cfg = config(arch, n_layer, **dims)
    g = Graph()
    g.outputs.insert(0, mod.build(cfg, g, Weights(g, ws, {**DIMS, **dims}["n_vocab"], where="synth"), shape))
    return g


class FakeModel:
    """What the Engine needs of a Model."""

    def __init__(self, arch: str, n_layer: int = 2, seed: int = 0) -> None:
        self.arch, self.n_layer = arch, n_layer
        self.weights = weights(arch, n_layer, seed)
        self.config = config(arch, n_layer)[1]
        self.layer_memory = self.config.layer_memory()
        self.kv_dims = [m.kv_dims for m in self.layer_memory]
        self.n_vocab = DIMS["n_vocab"]
        self.eog_ids = frozenset()

    def build_graph(self, shape: BatchShape) -> Graph:
        return build(self.arch, self.weights, shape, self.n_layer)


def step_feed(rng, n_layer: int, *, bs: int = 4, n_blocks: int = 10):
    """Two sequences over scattered blocks: a 5-token prefill chunk at positions 3..7 (0..2
    cached already) and one decode token at position 9; random stale/prior cache contents."""
    block_table = np.array([[5, 2, 7, 0], [1, 6, 3, 0]], np.int32)
    tok_seq = np.array([0, 0, 0, 0, 0, 1], np.int32)
    pos = np.array([3, 4, 5, 6, 7, 9], np.int32)
    slots = np.array([block_table[s, p // bs] * bs + p % bs for s, p in zip(tok_seq, pos)], np.int32)
    n = len(pos)
    feed = dict(tokens=rng.integers(0, DIMS["n_vocab"], n).astype(np.int32), pos=pos, tok_seq=tok_seq,
                slots=slots, block_table=block_table, out_rows=np.array([4, 5], np.int32))
    shape = BatchShape(n_tokens=n, n_seqs=2, max_blocks=4, n_out=2, n_slots=n_blocks * bs, block_size=bs)
    kv = (n_blocks * bs, DIMS["n_head_kv"], DIMS["head_dim"])
    caches = {(kind, il): rng.standard_normal(kv).astype(np.float32)
              for kind in ("cache_k", "cache_v") for il in range(n_layer)}
    return feed, shape, caches
