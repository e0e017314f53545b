"""Drafts from heads that run on the target's own state (llama.cpp's draft-mtp, common/speculative.cpp):
Gemma 4's assistant (model_zoo.models.gemma4_assistant) reads the target's K/V cache and its last hidden
state. The engine hands this drafter each step's hidden rows (`observe`: the output-normed hidden state of
the rows a drafting request may continue from); `propose` then drafts for all speculating requests in
batched one-token steps: the first from [the target's embedding of the request's last token, the hidden
row that predicted it], each next from [the drafted token's, the head's own next hidden state], all at the
last token's position (llama.cpp: "the same position for all draft tokens" with a shared cache).
Drafting stops at the first token below p_min confidence or an end-of-generation token; the target
verifies the drafts as for any drafter (runtime.speculative) and nothing is to roll back here."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from hearthlm.backends.reference import dequantize
from hearthlm.core.weights import QWeight
from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.dispatch import execute
from hearthlm.runtime.draft import P_MIN, DraftModel
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import ModelRunner
from hearthlm.runtime.seq_memory import SequenceMemory
from hearthlm.runtime.speculative import K_MAX, DraftLength


class HeadSeq(DraftLength):
    """One request's side: the target's hidden rows of its last step (those a draft can start from)."""
    wants_hidden = True  # the runner outputs every row's hidden state in steps with this request

    def __init__(self, k_max: int) -> None:
        super().__init__(k_max)
        self.h_rows: np.ndarray | None = None  # (n, n_embd) the target's output-normed hidden rows
        self.h_pos = 0                         # the position of the first of them


class _Runner(ModelRunner):
    """The head's graph over the target's sequence memory: its input rows come from the drafter."""

    def forward(self, plan: StepPlan, xh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feed, shape = self.inputs(plan)
        n = len(plan.seqs)
        feed["seq_len"] = np.maximum(feed["pos"], 1)  # the horizon: the target's tokens before the draft's
        rows = np.zeros((shape.n_tokens, xh.shape[1]), np.float32)
        rows[:n] = xh
        feed["inp_xh"] = rows
        logits, h_next = execute(self.graphs.get(shape), feed, self.memory.cache_of)[:2]
        return logits[:n], h_next[:n]


class AssistantDrafter:
    """Drafts for the speculating requests of one target engine with Gemma 4's assistant. `model`: the
    assistant bound to the target (gemma4_assistant.bind); `embd`: the target's token embeddings, scaled
    by `scale` (its width's square root) as the target scales them."""

    def __init__(self, model: Any, *, embd: QWeight, scale: float, k_max: int = K_MAX, p_min: float = P_MIN,
                 n_vocab: int | None = None) -> None:
        self.model, self.embd, self.scale = model, embd, scale
        self.k_max, self.p_min = k_max, p_min
        self.n_vocab = min(n_vocab or model.n_vocab, model.n_vocab)
        self.eog = frozenset(model.eog_ids)
        self.runner: _Runner | None = None
        self.steps = 0

    def attach(self, memory: SequenceMemory, placement: Placement, *, n_ctx: int, max_seqs: int,
               fusion: bool | None = None) -> None:
        """The target engine's memory (whose caches the head reads) and placement, once it has them."""
        self.runner = _Runner(self.model, placement, memory, n_ctx=n_ctx, max_batch_tokens=max_seqs, max_seqs=max_seqs,
                              fusion=fusion, tune_threads=False)

    def new_seq(self) -> HeadSeq:
        return HeadSeq(self.k_max)

    def release(self, spec: HeadSeq) -> None:
        spec.h_rows = None

    def stats(self) -> dict[str, Any]:
        return dict(draft_steps=self.steps)

    # ---- the target engine's thread -------------------------------------------------------
    def observe(self, plan: StepPlan, hidden: np.ndarray) -> None:
        """After the target's forward pass (before its update): keep each drafting request's rows a
        next draft may start from, its last token's and its drafts' (one of them predicts the next token)."""
        at = 0
        for s in plan.seqs:
            spec, k = s.req.spec, s.n_tokens
            if isinstance(spec, HeadSeq):
                d = min(len(s.req.draft), k - 1)
                spec.h_rows = hidden[at + k - 1 - d:at + k].copy()
                spec.h_pos = s.req.n_computed + k - 1 - d
            at += k
        # what is copied is small: 1 + drafts rows per drafting request

    def propose(self, items: list[tuple[Request, int]]) -> None:
        """Set r.draft for each (request, room): at most min(its k, room) tokens."""
        live = []
        for r, room in items:
            spec, p = r.spec, len(r.tokens) - 2  # the row that predicted the last token
            limit = min(spec.k, room)
            if limit > 0 and spec.h_rows is not None and spec.h_pos <= p < spec.h_pos + len(spec.h_rows):
                live.append((r, limit, r.tokens[-1], spec.h_rows[p - spec.h_pos]))
        while live:
            plan = StepPlan([Scheduled(_row(r), 1, True) for r, *_ in live], [])
            xh = np.concatenate([self._embed(np.array([t for _, _, t, _ in live], np.int64)),
                                 np.stack([h for *_, h in live])], axis=1)
            logits, h_next = self.runner.forward(plan, xh)
            self.steps += 1
            later = []
            for i, (r, limit, _, _) in enumerate(live):
                tok, p = DraftModel._greedy(logits[i])
                if p < self.p_min or tok >= self.n_vocab:
                    continue  # not confident enough: this request's draft ends here
                r.draft.append(tok)
                if len(r.draft) < limit and tok not in self.eog:
                    later.append((r, limit, tok, h_next[i]))
            live = later

    def _embed(self, toks: np.ndarray) -> np.ndarray:
        """The target's embedding rows of `toks`, scaled: (n, n_target) float32."""
        w = self.embd
        return dequantize(QWeight(w.name, w.ggml_type, (len(toks), w.shape[1]), w.raw[toks])) * np.float32(self.scale)


def _row(r: Request) -> SimpleNamespace:
    """The runner's view of a request for one draft row at its last token's position, over its blocks."""
    return SimpleNamespace(kind=Kind.DRAFT, tokens=r.tokens, draft=[], n_computed=len(r.tokens) - 1, blocks=r.blocks,
                           media=(), prompt_logprobs=None, lora=(), state_slot=None, max_tokens=0, spec=None)
