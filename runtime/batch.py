"""The shape of one engine step's batch: what a graph is built for (and cached by)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    n_tokens: int    # tokens computed this step, all sequences together
    n_seqs: int      # rows of the block table
    max_blocks: int  # columns of the block table
    n_out: int       # tokens whose logits are needed
    n_slots: int     # KV cache size in token slots (n_blocks * block_size)
    block_size: int  # tokens per KV block
    embd: bool = False  # also output every token's final hidden state (embedding requests pool them)
    n_state: int = 0    # recurrent-state slots (hybrid models; 0: none)


def one_token(block_size: int = 16, n_state: int = 0) -> BatchShape:
    """The smallest step: what load-time checks and weight packing build a graph for."""
    return BatchShape(n_tokens=1, n_seqs=1, max_blocks=1, n_out=1, n_slots=block_size, block_size=block_size,
                      n_state=n_state)
