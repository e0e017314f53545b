"""Drafts from heads that run on the target's own state (llama.cpp's draft-mtp, common/speculative.cpp).
The engine hands these drafters each step's hidden rows (`observe`: the target's output-normed hidden
state, what llama.cpp calls h_nextn); `propose` drafts for all their speculating requests in batched steps.
Drafting stops at the first token below p_min confidence or an end-of-generation token; the target
verifies the drafts as for any drafter (runtime.speculative).
- Gemma 4's assistant (AssistantDrafter; model_zoo.models.gemma4_assistant) reads the target's K/V cache:
  its first draft from [the target's embedding of the request's last token, the hidden row that predicted
  it], each next from [the drafted token's, the head's own next hidden state], all at the last token's
  position (llama.cpp: "the same position for all draft tokens" with a shared cache); nothing to roll back.
- Qwen3.5's MTP block (MTPDrafter; model_zoo.models.qwen35_mtp) keeps a K/V cache of its own, a draft
  model's memory (runtime.draft): its row at position q takes token q and the target's hidden row q - 1,
  so after each target step it catches up over the kept tokens (the rows it drafted from its own hidden
  state are recomputed from the target's, as llama.cpp's process() does), then drafts one token a step."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from hearthlm.backends.reference import dequantize
from hearthlm.core.errors import InvalidRequestError
from hearthlm.core.weights import QWeight
from hearthlm.runtime.batcher import Scheduled, StepPlan
from hearthlm.runtime.dispatch import execute
from hearthlm.runtime.draft import P_MIN, DraftModel, DraftSeq
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import ModelRunner, open_memory
from hearthlm.runtime.seq_memory import SequenceMemory
from hearthlm.runtime.speculative import DraftLength

K_MAX = 3  # draft tokens at most per step: llama.cpp's default (--draft-max) for draft-mtp; each costs a full LM head


def new_spec(how: str, draft: Any, mtp: Any) -> Any:
    """A speculating request's side of its drafter: "draft", the session's draft model (or assistant);
    "mtp", the model's own MTP block. InvalidRequestError where the session has none."""
    if how == "draft" and draft is None:
        raise InvalidRequestError("speculative='draft' needs a session opened with draft_model=")
    if how == "mtp" and mtp is None:
        raise InvalidRequestError("speculative='mtp' needs a model with multi-token-prediction (MTP, nextn) layers "
                                  "(Qwen3.5's): this model has none")
    return (draft if how == "draft" else mtp).new_seq()


def observe(plan: StepPlan, hidden: np.ndarray | None, *drafters: Any) -> None:
    """The target's hidden rows of a step to the drafters that draft from them."""
    for d in drafters if hidden is not None else ():
        if hasattr(d, "observe"):
            d.observe(plan, hidden)


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
        """The target engine's memory (whose caches the head reads) and placement, once it has them: the
        head runs where the target's output head (and last layers, whose caches it reads) are."""
        placement = Placement(placement.backends, [placement.output] * len(placement.layers))
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
        next draft may start from, its last token's and its drafts' (one of them predicts the next token:
        1 + drafts rows a request, a small copy)."""
        at = 0
        for s in plan.seqs:
            spec, k = s.req.spec, s.n_tokens
            if isinstance(spec, HeadSeq):
                d = min(len(s.req.draft), k - 1)
                spec.h_rows = hidden[at + k - 1 - d:at + k].copy()
                spec.h_pos = s.req.n_computed + k - 1 - d
            at += k

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
                tok, p = _greedy(logits[i])
                if p < self.p_min or tok >= self.n_vocab:
                    continue  # not confident enough: this request's draft ends here
                r.draft.append(tok)
                if len(r.draft) < limit and tok not in self.eog:
                    later.append((r, limit, tok, h_next[i]))
            live = later

    def _embed(self, toks: np.ndarray) -> np.ndarray:
        """The target's embedding rows of `toks`, scaled: (n, n_target) float32."""
        return _rows(self.embd, toks) * np.float32(self.scale)


def _row(r: Request) -> SimpleNamespace:
    """The runner's view of a request for one draft row at its last token's position, over its blocks."""
    return SimpleNamespace(kind=Kind.DRAFT, tokens=r.tokens, draft=[], n_computed=len(r.tokens) - 1, blocks=r.blocks,
                           media=(), prompt_logprobs=None, lora=(), state_slot=None, max_tokens=0, spec=None,
                           state_snaps={})


def _greedy(row: np.ndarray) -> tuple[int, float]:
    """The head's argmax and its probability, in float32 (over a 248K vocabulary float64 took 4 ms a row)."""
    tok = int(np.argmax(row))
    return tok, 1.0 / float(np.exp(row - row[tok]).sum(dtype=np.float32))


def _rows(w: QWeight, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a (quantized) table as float32."""
    return dequantize(QWeight(w.name, w.ggml_type, (len(ids), w.shape[1]), w.raw[ids]))


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


class MTPSeq(DraftSeq):
    """One request's MTP side: its view in the head's memory (DraftSeq), the target's hidden rows for
    positions [h_lo, h_lo + len(h)), the head's own last hidden row (at position mtp_pos), and how many
    leading positions the head computed from the target's rows (`valid`; those after are redone)."""
    wants_hidden = True

    def __init__(self, k_max: int, drafter: "MTPDrafter", n_embd: int) -> None:
        super().__init__(k_max)
        self.drafter = drafter
        self.seq.head = self  # the head's rows find their hidden inputs through it
        self.h, self.h_lo = np.zeros((0, n_embd), np.float32), 0
        self.h_mtp: np.ndarray | None = None
        self.mtp_pos = -1
        self.valid = 0
        self.t_end = 0  # the target's rows are its kept tokens' before this position

    def target_row(self, q: int) -> np.ndarray | None:
        """The target's hidden row at position q, where it has one."""
        return self.h[q - self.h_lo] if self.h_lo <= q < self.h_lo + len(self.h) else None


class MTPDrafter(DraftModel):
    """Drafts for the speculating requests of one target engine with its own MTP block (`head`:
    qwen35_mtp.head(model)), whose K/V is a draft model's memory. `embd`: the table the head embeds
    tokens with; `enorm`, `hnorm`: its input norms (the normed halves of its input are made here).
    Its memory and runner are made at its first draft (on the engine's thread): a session that never
    asks for "mtp" packs no second copy of the LM head and maps no K/V for it."""

    def __init__(self, head: Any, placement: Placement, *, embd: QWeight, enorm: QWeight, hnorm: QWeight, n_ctx: int,
                 kv_blocks: int | None = None, max_batch_tokens: int = 512, max_seqs: int = 64,
                 fusion: bool | None = None, kv_cache_type: str = "f16", k_max: int = K_MAX, p_min: float = P_MIN) -> None:
        self.head, self.placement, self.n_ctx, self.max_batch_tokens = head, placement, n_ctx, max_batch_tokens
        self._opts = dict(kv_blocks=kv_blocks, max_seqs=max_seqs, fusion=fusion, kv_cache_type=kv_cache_type)
        self.memory = self.runner = None
        self.k_max, self.p_min = k_max, p_min
        self.n_vocab, self.eog, self.steps = head.n_vocab, frozenset(head.eog_ids), 0
        self.embd, self.eps, self.n_embd = embd, head.config.norm_eps, head.config.n_embd
        self.enorm, self.hnorm = dequantize(enorm), dequantize(hnorm)

    def _open(self) -> None:
        o = self._opts
        self.memory = open_memory(self.head, self.placement, n_ctx=self.n_ctx, kv_blocks=o["kv_blocks"],
                                  max_seqs=o["max_seqs"], kv_cache_type=o["kv_cache_type"])
        self.runner = ModelRunner(self.head, self.placement, self.memory, n_ctx=self.n_ctx,
                                  max_batch_tokens=self.max_batch_tokens, max_seqs=o["max_seqs"], fusion=o["fusion"],
                                  tune_threads=False)

    def new_seq(self) -> MTPSeq:
        return MTPSeq(self.k_max, self, self.n_embd)

    def propose(self, items: list[tuple[Request, int]]) -> None:
        if self.runner is None:
            self._open()
        super().propose(items)

    def release(self, spec: MTPSeq) -> None:
        if self.memory is not None:
            super().release(spec)

    def stats(self) -> dict[str, Any]:
        mem = self.memory.stats() if self.memory is not None else dict(kv_blocks_used=0, kv_blocks_total=0)
        return dict(mtp_steps=self.steps, mtp_kv_blocks_used=mem["kv_blocks_used"], mtp_kv_blocks_total=mem["kv_blocks_total"])

    _greedy = staticmethod(_greedy)

    def observe(self, plan: StepPlan, hidden: np.ndarray) -> None:
        """The target's hidden rows of this step's positions, after the kept ones before them."""
        at = 0
        for s in plan.seqs:
            spec, k, c = s.req.spec, s.n_tokens, s.req.n_computed
            if isinstance(spec, MTPSeq) and spec.drafter is self:
                keep = c - spec.h_lo
                if 0 <= keep <= len(spec.h):
                    spec.h = np.concatenate([spec.h[:keep], hidden[at:at + k]])
                else:  # a prefix the target took from its cache: the head has no rows there (zeros)
                    spec.h, spec.h_lo = hidden[at:at + k].copy(), c
            at += k

    def _sync(self, r: Request, spec: MTPSeq, limit: int) -> bool:
        """As a draft model's, less the rows the head drafted from its own hidden state."""
        spec.seq.n_computed = min(spec.seq.n_computed, spec.valid)
        spec.t_end = len(r.tokens) - 1
        ok = super()._sync(r, spec, limit)
        spec.valid = spec.seq.n_computed
        drop = spec.valid - 1 - spec.h_lo  # rows before the one the next row takes are done with
        if drop > 0:
            spec.h, spec.h_lo = spec.h[drop:], spec.h_lo + drop
        return ok

    def _forward(self, batch: list[Scheduled]) -> np.ndarray:
        plan = StepPlan(batch, [])
        feed, shape = self.runner.inputs(plan)
        toks, hs = [], []
        for sch in batch:
            s, spec = sch.req, sch.req.head
            for q in range(s.n_computed, s.n_computed + sch.n_tokens):
                h = spec.target_row(q - 1) if q - 1 < spec.t_end else None
                if q - 1 < spec.t_end:  # a kept token's row: the target's (zeros before the first, or where
                    spec.valid = max(spec.valid, q + 1)  # the target took a prefix from its cache)
                elif q - 1 == spec.mtp_pos:  # a drafted token's: the block's own output before it
                    h = spec.h_mtp
                if h is None:
                    h = np.zeros(self.n_embd, np.float32)
                toks.append(s.tokens[q])
                hs.append(h)
        eh = np.zeros((shape.n_tokens, 2 * self.n_embd), np.float32)
        n = len(toks)
        eh[:n, :self.n_embd] = _rms(_rows(self.embd, np.array(toks, np.int64)), self.enorm, self.eps)
        eh[:n, self.n_embd:] = _rms(np.stack(hs), self.hnorm, self.eps)
        feed["inp_eh"] = eh
        logits, h_next = execute(self.runner.graphs.get(shape), feed, self.memory.cache_of)[:2]
        row = 0
        for sch in batch:
            s = sch.req
            if sch.wants_logits:
                s.head.h_mtp, s.head.mtp_pos = h_next[row].copy(), s.n_computed + sch.n_tokens - 1
                row += 1
            s.n_computed += sch.n_tokens
        self.steps += 1
        return logits
