"""Paged KV cache: per layer one K and one V buffer of n_blocks * block_size token slots;
sequences own lists of blocks (their block table). Blocks are reference counted so that a
shared prompt prefix can be held by several sequences."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

from hearthlm.core import kv_types
from hearthlm.core.backend import Backend
from hearthlm.core.errors import InvalidRequestError
from hearthlm.core.graph import Graph, Op, Tensor


class BlockAllocator:
    """Reference-counted blocks. A full block can be registered under the hash of its tokens
    (and all tokens before it); freed blocks keep that hash until they are handed out again,
    so a later request with the same prefix takes them back instead of recomputing."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))  # LRU first
        self._ref = np.zeros(n_blocks, np.int32)
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.on_drop = lambda h: None  # told when a block's registered hash goes (its contents are reused)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)  # its old contents are about to be overwritten
            if h is not None:
                del self._by_hash[h]
                self.on_drop(h)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def register(self, block: int, h: int) -> None:
        """`block` is full and holds the tokens hashed by h."""
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def take_cached(self, h: int) -> int | None:
        """The block registered under h, with a reference taken, or None."""
        b = self._by_hash.get(h)
        if b is None:
            return None
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1
        return b


def block_hash(parent: int | None, tokens) -> int:
    return hash((parent, tuple(tokens)))


def kv_layout(kv_type: str, kv_dims: list[tuple[int, int]], backends: list[Backend]):
    """Per layer, the (per-slot shape, dtype) of its K and V caches (core.kv_types' record of the
    type: the same on every backend); InvalidRequestError for a type that cannot hold them."""
    why = kv_types.check(kv_type, kv_dims)
    if why:
        raise InvalidRequestError(why)
    t, _ = kv_types.parse(kv_type)
    return [((h, t.row(d)), t.storage) for h, d in kv_dims]


class KVCache:
    def __init__(self, kv_dims: list[tuple[int, int]], n_blocks: int, block_size: int,
                 backends: list[Backend], kv_type: str = "f16") -> None:
        """kv_dims and backends: per layer, (n_head_kv, head_dim) and the backend that runs its
        attention, where its K/V live. kv_type: a core.kv_types name ("f16", "q8_0", ...; "+rot"
        for the Hadamard rotation), what every layer's K and V store."""
        assert len(backends) == len(kv_dims), (len(backends), len(kv_dims))
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.n_slots = n_blocks * block_size
        self.allocator = BlockAllocator(n_blocks)
        self.backends = backends
        self.kv_type = kv_type
        self.kv_dims = kv_dims
        layout = kv_layout(kv_type, kv_dims, backends)
        self.k = [be.zeros((self.n_slots, *row), dt) for be, (row, dt) in zip(backends, layout)]
        self.v = [be.zeros((self.n_slots, *row), dt) for be, (row, dt) in zip(backends, layout)]
        # per layer, the Hadamard sizes of K and V (0: none)
        self.rot = [kv_types.rot_sizes(kv_type, d) if h else (0, 0) for h, d in kv_dims]
        # K and V bytes of one token, all layers
        self.bytes_per_token = sum(2 * int(np.prod(row)) * dt.itemsize for row, dt in layout)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def cache_of(self, node: Tensor):
        return (self.k if node.name == "cache_k" else self.v)[node.layer]

    def typed(self, build: Callable[..., Graph]) -> Callable[..., Graph]:
        """`build` (a batch shape -> the model's graph) with each K/V cache node tagged with this
        cache's type (core.kv_types.tag), as ggml's type_k / type_v: kernels are bound from it."""
        def typed_build(*args, **kwargs) -> Graph:
            g = build(*args, **kwargs)
            for n in g.nodes:
                if n.op is Op.CACHE and n.name in ("cache_k", "cache_v"):
                    kv_types.tag(n, self.kv_type, self.rot[n.layer][n.name == "cache_v"])
            return g
        return typed_build

    def key(self) -> list[list]:
        """Per layer [backend, type, h, d], as the prompt cache's files are keyed (a float type
        by its dtype string, as before the registry: those files stay valid)."""
        name = kv_types.key_name(self.kv_type)
        return [[be.name, name, h, d] for be, (h, d) in zip(self.backends, self.kv_dims)]

    def slots_of(self, blocks: list[int]) -> np.ndarray:
        """The token slots of these blocks, in order."""
        return (np.asarray(blocks, np.int64)[:, None] * self.block_size + np.arange(self.block_size)).ravel()
