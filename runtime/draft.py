"""Draft-model speculation (Session.open(draft_model=...)): a smaller model of the target's
vocabulary proposes each speculating request's next tokens, greedily; the target verifies them
as extra rows of its own step (as for prompt lookup, runtime.speculative) and rolls back what it
rejects. The draft model has a model runner of its own (runtime.runner) and its own sequence
memory (a KV block table per request, released with the request), run from the target
engine's thread, all speculating requests batched: one catch-up step (the tokens the target
kept since the last draft, or the whole prompt the first time), then one-token steps. A
recurrent (hybrid) draft model keeps its state after each drafted position in rollback slots
(runtime.seq_memory), as the target does, and goes back to the one the target's verdict leaves.
Drafting stops at the draft's first token below p_min confidence (llama.cpp's --draft-p-min)."""
from __future__ import annotations

from typing import Any

import numpy as np

from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import ROLLBACK_SLOTS, ModelRunner, open_memory
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.runtime.speculative import K_MAX, DraftLength

P_MIN = 0.75  # a draft token the draft model itself gives less than this is not proposed (llama.cpp's default)


class DraftSeq(DraftLength):
    """One request's side of the draft model: the draft model's view of its tokens (a
    Kind.DRAFT request of the draft's memory, whose K/V is valid for its first n_computed
    tokens) and the draft length, adapted as for n-gram drafts."""

    def __init__(self, k_max: int) -> None:
        super().__init__(k_max)
        self.seq = Request(prompt=[], params=SamplingParams(temperature=0.0), max_tokens=0, kind=Kind.DRAFT,
                           on_token=lambda t, lp: None, on_finish=lambda reason, err: None)
        self.admitted = False


class DraftModel:
    """Drafts for the speculating requests of one target engine, with the draft model's own
    runner and memory (of the target's context, or the draft's own where shorter)."""

    def __init__(self, model: Any, placement: Placement, *, n_ctx: int, kv_blocks: int | None = None,
                 max_batch_tokens: int = 512, max_seqs: int = 64, fusion: bool | None = None, weight_cache=None,
                 kv_cache_type: str = "f16", k_max: int = K_MAX, p_min: float = P_MIN,
                 n_vocab: int | None = None, rollback_slots: int = ROLLBACK_SLOTS) -> None:
        """`n_vocab`: the target's vocabulary (drafts beyond it are not proposed). `rollback_slots`:
        a recurrent draft model's state slots for its states after drafted positions, shared by the
        requests (each drafts at most one token more than it gets)."""
        self.n_ctx, self.max_batch_tokens = n_ctx, max_batch_tokens
        self.memory = open_memory(model, placement, n_ctx=n_ctx, kv_blocks=kv_blocks, max_seqs=max_seqs,
                                  kv_cache_type=kv_cache_type, rollback_slots=rollback_slots)
        self.runner = ModelRunner(model, placement, self.memory, n_ctx=n_ctx, max_batch_tokens=max_batch_tokens,
                                  max_seqs=max_seqs, fusion=fusion, weight_cache=weight_cache, tune_threads=False)
        self.k_max, self.p_min = k_max, p_min
        self.n_vocab = min(n_vocab or model.n_vocab, model.n_vocab)  # drafts the target can take
        self.eog = frozenset(model.eog_ids)
        self.steps = 0

    def new_seq(self) -> DraftSeq:
        return DraftSeq(self.k_max)

    def release(self, spec: DraftSeq) -> None:
        """The request is done: its draft blocks go back (the prefix cache may keep them)."""
        self.memory.release(spec.seq)
        spec.admitted = False

    def stats(self) -> dict[str, Any]:
        mem = self.memory.stats()
        return dict(draft_steps=self.steps, draft_kv_blocks_used=mem["kv_blocks_used"],
                    draft_kv_blocks_total=mem["kv_blocks_total"])

    # ---- the target engine's thread -------------------------------------------------------
    def propose(self, items: list[tuple[Request, int]]) -> None:
        """Set r.draft for each (request, room): at most min(its k, room) tokens."""
        pending = []
        for r, room in items:
            limit = min(r.spec.k, room, self.n_ctx - len(r.tokens))  # the draft's context may be shorter
            limit = self._sync(r, r.spec, limit) if limit > 0 else 0
            if limit > 0:
                pending.append((r, r.spec.seq, limit))
        budget = self.max_batch_tokens
        while pending:  # catch-up chunks (a long prompt over several steps), then one token a step
            batch, later, used = [], [], 0
            for item in pending:
                s = item[1]
                take = min(len(s.tokens) - s.n_computed, budget - used)
                if take <= 0:
                    later.append(item)
                    continue
                batch.append((item, Scheduled(s, take, s.n_computed + take == len(s.tokens))))
                used += take
            logits, row = self._forward([sch for _, sch in batch]), 0
            for item, sch in batch:
                if not sch.wants_logits:  # a prompt chunk: more of it next time round
                    later.append(item)
                    continue
                (r, s, limit), (tok, p) = item, self._greedy(logits[row])
                row += 1
                if p < self.p_min or tok >= self.n_vocab:
                    continue  # not confident enough: this request's draft ends here
                r.draft.append(tok)
                if len(r.draft) < limit and tok not in self.eog:
                    s.tokens.append(tok)
                    later.append(item)
            pending = later

    def _sync(self, r: Request, spec: DraftSeq, limit: int) -> int:
        """Roll the draft's view back to the longest prefix it shares with the request's tokens
        (K/V computed beyond is overwritten later; a recurrent draft model's state goes back to
        the rollback point reserved when it drafted), take its blocks and this round's rollback
        points. Returns how many tokens it may draft: 0 if its blocks are not to be had."""
        s, mem = spec.seq, self.memory
        n = 0
        upto = min(s.n_computed, len(r.tokens) - 1)  # the last token is fed again: its logits draft
        while n < upto and s.tokens[n] == r.tokens[n]:
            n += 1
        if spec.admitted:
            n = mem.rollback(s, n)
        del s.tokens[n:]
        s.tokens.extend(r.tokens[n:])
        s.n_computed = n
        if not spec.admitted:  # a prefix the draft model computed for another request is taken back
            s.prompt = list(r.tokens)
            mem.admit(s)
            spec.admitted = True
        else:
            mem.after_step(s)  # full blocks of verified tokens findable by later prompts
        if not mem.grow(s, len(s.tokens) + limit - 1):
            return 0
        # the state after the request's tokens and after each draft token fed back (all but the last)
        n0 = len(r.tokens)
        return 1 + mem.reserve_rollback(s, range(n0, n0 + limit - 1))

    def _forward(self, batch: list[Scheduled]) -> np.ndarray:
        out = self.runner.run(StepPlan(batch, [])).logits
        for sch in batch:
            sch.req.n_computed += sch.n_tokens
        self.steps += 1
        return out

    @staticmethod
    def _greedy(row: np.ndarray) -> tuple[int, float]:
        """The draft model's argmax and its probability."""
        tok = int(np.argmax(row))
        m = float(row[tok])
        return tok, 1.0 / float(np.exp(row.astype(np.float64) - m).sum())
