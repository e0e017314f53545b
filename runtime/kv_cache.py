"""Paged KV cache: per layer one K and one V buffer of n_blocks * block_size token slots;
sequences own lists of blocks (their block table). Blocks are reference counted so that a
shared prompt prefix can be held by several sequences."""
from __future__ import annotations

import numpy as np

from hearthlm.runtime.graph import Tensor


class BlockAllocator:
    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = np.zeros(n_blocks, np.int32)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._ref[out] = 1
        return out

    def share(self, block: int) -> None:
        self._ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)


class KVCache:
    def __init__(self, kv_dims: list[tuple[int, int]], n_blocks: int, block_size: int, backend) -> None:
        """kv_dims: per layer (n_head_kv, head_dim)."""
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.n_slots = n_blocks * block_size
        self.allocator = BlockAllocator(n_blocks)
        alloc = lambda shape: backend.from_host(np.zeros(shape, np.float32))  # noqa: E731
        self.k = [alloc((self.n_slots, h, d)) for h, d in kv_dims]
        self.v = [alloc((self.n_slots, h, d)) for h, d in kv_dims]

    @staticmethod
    def bytes_per_token(kv_dims: list[tuple[int, int]]) -> int:
        return sum(2 * h * d * 4 for h, d in kv_dims)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def cache_of(self, node: Tensor):
        return (self.k if node.name == "cache_k" else self.v)[node.layer]
