"""The batcher: each step, which requests advance and by how many tokens, under a token
budget. No prefill or decode mode: a request wants len(tokens) - n_computed tokens;
decoding requests (wanting 1) go first, then prompt chunks, as vLLM v1 does."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hearthlm.runtime.request import Request, chunk_past_media
from hearthlm.runtime.seq_memory import SequenceMemory

# embedding tokens a step takes while generations run: an embedding's prompt is prefill work that
# would otherwise stretch every decode step it joins (a 72-token text cost SmolLM2's 8 streams
# 4/5 of their rate); so capped, it is pooled over a few steps and decoding keeps its pace
POOL_TOKENS_BESIDE_GENERATION = 16
# prompt tokens a scored request (prompt log-probs) takes per step: each brings a row of logits
# (n_vocab floats: 256 rows of a 152k vocabulary are 155 MB)
SCORED_TOKENS_PER_STEP = 256


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
    def __init__(self, memory: SequenceMemory, *, max_batch_tokens: int, max_seqs: int, whole: bool = False) -> None:
        self.memory = memory
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.whole = whole  # an encoder's: a request runs all its tokens in one step, or waits

    def release(self, req: Request) -> None:
        self.memory.release(req)

    def preempt(self, req: Request) -> None:
        self.memory.release(req)
        req.draft = []
        req.n_preempted += 1
        req.pooled = None  # an embedding pools what is computed: it starts again with it

    def _take(self, req: Request, budget: int) -> int:
        if self.whole:
            return req.n_wanted if req.n_wanted <= budget else 0
        if req.kind.pools:
            budget = min(budget, self._pool_left)
        if req.prompt_logprobs is not None and req.n_computed < len(req.prompt) - 1:
            budget = min(budget, SCORED_TOKENS_PER_STEP)
        if req.draft and req.n_wanted > budget:  # a draft is cut to the budget (verified whole or not at all)
            del req.draft[max(budget - 1, 0):]
        take = min(req.n_wanted, budget, self.memory.chunk_end(req) - req.n_computed)
        # an image that attends both ways is computed in one chunk, past the budget if it must be
        return chunk_past_media(req.media, req.n_computed, take) if req.media else take

    def plan(self, running: list[Request], waiting: deque[Request]) -> StepPlan:
        mem = self.memory
        budget = self.max_batch_tokens
        generating = any(not r.kind.pools for r in running)
        self._pool_left = POOL_TOKENS_BESIDE_GENERATION if generating and not self.whole else budget
        seqs: list[Scheduled] = []
        preempted: list[Request] = []
        # decode first (wanting one token), then prompt chunks already under way
        for req in sorted(running, key=lambda r: (r.n_wanted > 1 + len(r.draft), r.arrival)):
            if req in preempted or budget <= 0:
                continue
            take = self._take(req, budget)
            if take == 0:  # a whole input waits for a step with room for all of it
                continue
            while not mem.grow(req, req.n_computed + take):
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
            seqs.append(Scheduled(req, take, req.n_computed + take == req.n_total))
            budget -= take
            self._pool_left -= take if req.kind.pools else 0
        # a request moving between the lists joins the next before it leaves the last, so that
        # Engine.stats (another thread) never misses it while it holds blocks
        for req in reversed(preempted):  # oldest first back at the head of the queue
            waiting.appendleft(req)
        for req in preempted:
            running.remove(req)
        # admit waiting requests while budget, sequences, state slots and blocks allow
        while waiting and budget > 0 and len(running) < self.max_seqs and not preempted:
            req = waiting[0]
            if not mem.admit(req):
                break
            take = self._take(req, budget)
            # 0: a whole input that does not fit this step, or this step's embedding share is spent
            if take == 0 or not mem.grow(req, req.n_computed + take):
                mem.unadmit(req)
                break
            running.append(req)
            waiting.popleft()
            seqs.append(Scheduled(req, take, req.n_computed + take == req.n_total))
            budget -= take
            self._pool_left -= take if req.kind.pools else 0
        return StepPlan(seqs, preempted)
