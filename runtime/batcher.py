"""The batcher: each step, which requests advance and by how many tokens, under a token
budget. No prefill or decode mode: a request wants len(tokens) - n_computed tokens;
decoding requests (wanting 1) go first, then prompt chunks, as vLLM v1 does."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hearthlm.runtime.kv_cache import KVCache, block_hash
from hearthlm.runtime.request import Request


@dataclass
class Scheduled:
    req: Request
    n_tokens: int       # tokens computed for this request this step
    wants_logits: bool  # the chunk reaches the end of the request's tokens: sample after it


@dataclass
class StepPlan:
    seqs: list[Scheduled]   # in batch order
    preempted: list[Request]  # sent back to waiting (blocks freed, recomputed later)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.seqs)


class Batcher:
    def __init__(self, kv: KVCache, *, max_batch_tokens: int, max_seqs: int) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.reused_tokens = 0  # prompt tokens taken from the prefix cache instead of computed

    def _grow(self, req: Request, n_tokens: int) -> bool:
        """Make sure req owns blocks for its first n_tokens tokens."""
        need = self.kv.blocks_for(n_tokens) - len(req.blocks)
        if need <= 0:
            return True
        got = self.kv.allocator.alloc(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def release(self, req: Request) -> None:
        """Free the request's blocks; it will recompute from scratch (prefix cache permitting)."""
        self.kv.allocator.free(req.blocks)
        req.blocks, req.block_hashes, req.n_computed = [], [], 0

    def preempt(self, req: Request) -> None:
        self.release(req)
        req.n_preempted += 1
        req.pooled = None  # an embedding pools what is computed: it starts again with it

    def reuse_prefix(self, req: Request) -> int:
        """Take cached blocks for the request's leading full blocks; returns the tokens reused.
        At least one token is left to compute: its logits are needed."""
        bs, alloc = self.kv.block_size, self.kv.allocator
        h = None
        for i in range((len(req.tokens) - 1) // bs):
            h = block_hash(h, req.tokens[i * bs:(i + 1) * bs])
            b = alloc.take_cached(h)
            if b is None:
                break
            req.blocks.append(b)
            req.block_hashes.append(h)
        req.n_computed = len(req.blocks) * bs
        return req.n_computed

    def register_full_blocks(self, req: Request) -> None:
        """After a step: make the request's newly completed blocks findable by later prompts."""
        bs, alloc = self.kv.block_size, self.kv.allocator
        while len(req.block_hashes) < req.n_computed // bs:
            i = len(req.block_hashes)
            h = block_hash(req.block_hashes[-1] if i else None, req.tokens[i * bs:(i + 1) * bs])
            alloc.register(req.blocks[i], h)
            req.block_hashes.append(h)

    def plan(self, running: list[Request], waiting: deque[Request]) -> StepPlan:
        budget = self.max_batch_tokens
        seqs: list[Scheduled] = []
        preempted: list[Request] = []
        # decode first (wanting one token), then prompt chunks already under way
        for req in sorted(running, key=lambda r: (r.n_wanted > 1, r.arrival)):
            if req in preempted or budget == 0:
                continue
            take = min(req.n_wanted, budget)
            while not self._grow(req, req.n_computed + take):
                victim = max((r for r in running if r not in preempted), key=lambda r: r.arrival)
                self.preempt(victim)
                preempted.append(victim)
                for s in [s for s in seqs if s.req is victim]:  # already placed this step
                    seqs.remove(s)
                    budget += s.n_tokens
                if victim is req:
                    break
            if req in preempted:
                continue
            seqs.append(Scheduled(req, take, req.n_computed + take == len(req.tokens)))
            budget -= take
        for req in preempted:
            running.remove(req)
        for req in reversed(preempted):  # oldest first back at the head of the queue
            waiting.appendleft(req)
        # admit waiting requests while budget, sequences and blocks allow
        while waiting and budget > 0 and len(running) < self.max_seqs and not preempted:
            req = waiting[0]
            if not req.blocks and not req.pooling:  # embeddings pool every token: none reused
                self.reused_tokens += self.reuse_prefix(req)
            take = min(req.n_wanted, budget)
            if not self._grow(req, req.n_computed + take):
                self.reused_tokens -= req.n_computed
                self.release(req)
                break
            waiting.popleft()
            running.append(req)
            seqs.append(Scheduled(req, take, req.n_computed + take == len(req.tokens)))
            budget -= take
        return StepPlan(seqs, preempted)
