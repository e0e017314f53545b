"""The shape of one engine step's batch (what a graph is built for, and cached by), and the
output rows each scheduled request brings to it: the model runner lays them out, the output
processor reads them back in the same order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hearthlm.runtime.request import Kind

if TYPE_CHECKING:
    from hearthlm.runtime.batcher import Scheduled


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
    n_media: int = 0    # rows of the image-row input (a zero row, then the step's image rows; 0: no images)
    lora: tuple[str, ...] = ()  # the LoRA adapters' keys the graph carries (all live ones; () where no request uses any)


def one_token(block_size: int = 16, n_state: int = 0) -> BatchShape:
    """The smallest step: what load-time checks and weight packing build a graph for."""
    return BatchShape(n_tokens=1, n_seqs=1, max_blocks=1, n_out=1, n_slots=block_size, block_size=block_size,
                      n_state=n_state)


# A request's output rows in a step, in this order: one per scored prompt position
# (`scored`), then its last token's (`has_out_row`) and one per draft token.

def has_out_row(s: Scheduled) -> bool:
    """Whether this step computes the request's output row: at the chunk that ends its tokens, a
    generation (with room to generate), a reranker's scored token, a draft model's next token.
    Embeddings pool hidden states and need none (no LM head for them), nor do scored or
    prefilled prompts."""
    k = s.req.kind
    return s.wants_logits and (k in (Kind.RANK, Kind.DRAFT) or k is Kind.GENERATE and s.req.max_tokens > 0)


def n_out(s: Scheduled) -> int:
    """Output rows this step computes for the request: its last token's, and one per draft token."""
    return (1 + len(s.req.draft)) if has_out_row(s) else 0


def scored(s: Scheduled) -> range:
    """Positions of this chunk whose logits score the next prompt token (prompt_logprobs)."""
    r = s.req
    if r.prompt_logprobs is None:
        return range(0)
    lo = max(r.n_computed, len(r.prompt_lps))  # a recomputation (after preemption) scores nothing twice
    return range(lo, max(lo, min(r.n_computed + s.n_tokens, len(r.prompt) - 1)))
