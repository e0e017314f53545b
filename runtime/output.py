"""The output processor: what a step's output rows come to, per request. Generations sample
their next token (or verify their draft along its rows) under their grammar's mask, which a
worker thread fills while the forward pass runs, and meet their stops; scored prompts take
their tokens' log-probs; embeddings pool hidden rows, rerankers take their head's output.
Generated tokens are appended to the request (the next row's sampling reads them) and
returned with what finished, for the engine to deliver and release. Detokenization and stop
strings stay with the caller (sdk's ChoiceOutput): the engine holds no tokenizer."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hearthlm.core.errors import HearthError
from hearthlm.runtime.batch import scored
from hearthlm.runtime.batcher import StepPlan
from hearthlm.runtime.constraint import GrammarError, MaskWorker
from hearthlm.runtime.request import Kind, Request
from hearthlm.runtime.runner import StepOutput
from hearthlm.runtime.sampling import logsumexp_rows, penalized, sample, sample_top_k, steer, top_logprobs, verify

TopLogprobs = list[tuple[int, float]] | None


def plain(r: Request) -> bool:
    """Whether a generation's next token follows from its row and sampling parameters alone: no
    grammar, reasoning budget, log-probs, penalties, logit bias or min_tokens ban in play."""
    p = r.params
    return (r.matcher is None and r.think is None and not p.top_logprobs and not p.logit_bias
            and r.n_generated >= p.min_tokens and not penalized(p))


def by_rule(r: Request) -> bool:
    """Whether a generation's next token is its output row's, sampled by its parameters alone
    (`plain`, no draft to verify): emit_by_rule's rows, which `picks` may take where the logits are."""
    return not r.draft and plain(r)


# a sampled row's top_k up to which its candidates are taken where the logits are (beyond, its logits)
PICK_MAX = 1024


@dataclass
class Outcome:
    """What one scheduled request's step came to."""
    req: Request
    tokens: list[tuple[int, TopLogprobs]] = field(default_factory=list)  # appended this step, to deliver in order
    kept: int = 0  # draft tokens kept whose K/V this step computed (the rest are rolled back)
    finish: str | None = None  # "stop", "length" or "error": the request is done
    error: BaseException | None = None


class OutputProcessor:
    def __init__(self, n_vocab: int, eog_ids, n_ctx: int) -> None:
        self.n_vocab, self.eog, self.n_ctx = n_vocab, eog_ids, n_ctx
        self._masks: MaskWorker | None = None  # started with the first constrained request
        self.ttft: deque[float] = deque(maxlen=1000)  # time to first token of recent requests
        self.counters = dict(tokens_generated=0, spec_drafted_tokens=0, spec_accepted_tokens=0)

    # ---- grammar masks, filled while the forward pass runs ------------------------------
    def start_masks(self, plan: StepPlan):
        """Start filling the masks of the plan's constrained rows; None where it has none."""
        constrained = [s.req for s in plan.seqs if s.wants_logits and s.req.matcher is not None]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = MaskWorker(self.n_vocab)
        return constrained, self._masks.start([r.matcher for r in constrained], [r.draft for r in constrained])

    def join_masks(self, job) -> dict[int, np.ndarray]:
        """Each constrained request's mask rows (one, and one per draft token), by id(request).
        The matchers are not touched again before this returns."""
        if job is None:
            return {}
        constrained, future = job
        masks = self._masks.join(future)
        at = np.cumsum([0] + [1 + len(r.draft) for r in constrained])  # each one's mask rows
        return {id(r): masks[at[i]:at[i + 1]] for i, r in enumerate(constrained)}

    # ---- the step's outputs ---------------------------------------------------------------
    def picks(self, plan: StepPlan) -> np.ndarray | None:
        """Each output row's k (1: greedy, else its top_k), where every output row is a generation's
        next token by rule (`by_rule`) that its k largest logits decide: the step then takes those
        where the logits are (ModelRunner.run), not the logits. None where some row needs its logits."""
        ks = []
        for s in plan.seqs:
            r = s.req
            if r.kind is not Kind.GENERATE or scored(s):
                return None
            if not s.wants_logits:  # a prompt chunk: no output row
                continue
            if r.max_tokens == 0 or not by_rule(r):
                return None
            p = r.params
            k = 1 if p.greedy else p.top_k
            if not 0 < k < self.n_vocab or k > PICK_MAX:
                return None
            ks.append(k)
        return np.array(ks, np.int64)

    def process(self, plan: StepPlan, out: StepOutput, masks: dict[int, np.ndarray]) -> list[Outcome]:
        """One Outcome per scheduled request, in plan order. Reads the output rows in the order
        the runner laid them out (runtime.batch): scored prompt positions, then the last row
        and one per draft token."""
        outcomes, row, off, now = [], 0, 0, time.perf_counter()
        ruled: list[tuple[Outcome, int]] = []  # (outcome, its row) of the generations by rule
        for s in plan.seqs:
            r, o, first = s.req, Outcome(s.req), off
            off += s.n_tokens
            outcomes.append(o)
            positions = scored(s)
            if positions:
                self.score_prompt(r, positions, out.logits[row:row + len(positions)])
                row += len(positions)
            if r.kind is Kind.EMBED:  # pools this chunk's rows (no output row)
                o.finish = self.pool(r, out.hidden[first:off], last=s.wants_logits)
            elif not s.wants_logits:  # a prompt chunk: more of it next step
                continue
            elif r.kind is Kind.RANK:  # a reranker's score: the head's output at the scored row
                r.pooled = np.array(out.logits[row], np.float64)
                row, o.finish = row + 1, "stop"
            elif r.kind is not Kind.GENERATE or r.max_tokens == 0:  # a prompt scored or cached, nothing generated
                o.finish = "stop"
            elif by_rule(r):  # its token by rule alone: with the others', below
                ruled.append((o, row))
                row += 1
            else:
                n = 1 + len(r.draft)
                self.counters["spec_drafted_tokens"] += n - 1
                self.emit(o, out.logits[row:row + n], masks.get(id(r)), now)
                row += n
        if ruled:
            self.emit_by_rule(ruled, out, now)
        return outcomes

    def emit_by_rule(self, ruled: list[tuple[Outcome, int]], out: StepOutput, now: float) -> None:
        """The next token of each request whose row is sampled by its parameters alone (`by_rule`),
        as emit would choose it: the greedy ones' argmax in one pass over their rows, the others
        sampled; from the step's picks where it was asked for those (`picks`), else its logits."""
        logits, picks = out.logits, out.picks
        greedy = [(o, j) for o, j in ruled if o.req.params.greedy]
        if greedy:  # over the rows' span: the rows of others in between cost less than a copy of these
            at = np.fromiter((j for _, j in greedy), np.intp, len(greedy))
            best = (picks.ids[at, 0] if picks is not None
                    else logits[at[0]:at[-1] + 1].argmax(axis=1)[at - at[0]]).tolist()
            for (o, _), tok in zip(greedy, best):
                self._took(o, tok, now)
        for o, j in ruled:
            p = o.req.params
            if not p.greedy:
                try:
                    if picks is not None:
                        tok = sample_top_k(picks.ids[j, :p.top_k], picks.values[j, :p.top_k], bool(picks.ok[j]),
                                           p, o.req.rng)
                    else:
                        tok = sample(logits[j], p, o.req.rng, ())
                except Exception as e:  # this request's sampling, not its neighbours'
                    o.finish, o.error = "error", HearthError(f"sampling failed: {type(e).__name__}: {e}")
                    continue
                self._took(o, tok, now)

    def _took(self, o: Outcome, tok: int, now: float) -> None:
        """A plain request's sampled token: its stops, else appended; emit's steps for one row."""
        r = o.req
        if self._arrived(o, tok, now):
            return
        r.append(tok)
        r.n_generated += 1
        self.counters["tokens_generated"] += 1
        o.tokens.append((tok, None))
        if r.n_generated >= r.max_tokens or len(r.tokens) >= self.n_ctx:
            o.finish = "length"

    def _arrived(self, o: Outcome, tok: int, now: float) -> bool:
        """A sampled token's arrival: the request's time to first token where it is its first; True
        where it ends the generation (end of generation, a stop token), which then takes nothing."""
        r = o.req
        if r.first_token_at is None:
            r.first_token_at = now
            self.ttft.append(now - r.arrival)
        if (tok in self.eog and not r.params.ignore_eos) or tok in r.params.stop_token_ids:
            o.finish = "stop"
            return True
        return False

    def emit(self, o: Outcome, rows: np.ndarray, masks: np.ndarray | None, now: float) -> None:
        """Sample the request's next token from rows[0], or, where it drafted, verify its draft
        along the rows (row j follows draft token j-1): the tokens kept, then the one the target
        chose after them, and what the grammar or a reasoning budget forces after that."""
        r = o.req
        for j in range(len(rows)):
            try:
                tok, tlp, ok, forced = self._pick(r, rows[j], None if masks is None else masks[j], j)
            except GrammarError as e:  # this request's grammar, not its neighbours'
                o.finish, o.error = "error", e
                return
            except Exception as e:  # this request's sampling, not its neighbours'
                o.finish, o.error = "error", HearthError(f"sampling failed: {type(e).__name__}: {e}")
                return
            if self._arrived(o, tok, now):
                return
            for t, lp in [(tok, tlp), *((t, None) for t in forced)]:
                r.append(t)
                r.n_generated += 1
                self.counters["tokens_generated"] += 1
                o.tokens.append((t, lp))
            if r.matcher is not None and r.matcher.done:  # only end-of-generation could follow
                o.finish = "stop"
                return
            if r.n_generated >= r.max_tokens or len(r.tokens) >= self.n_ctx:
                o.finish = "length"
                return
            if not ok or forced:  # the target chose otherwise (or forced tokens come next): the rest is dropped
                return
            o.kept += 1  # the kept draft token's K/V were computed in this step

    def _pick(self, r: Request, logits: np.ndarray, mask: np.ndarray | None, j: int):
        """Row j's token: (token, its top log-probs or None, whether it is draft token j, the
        tokens forced after it). The grammar takes the token in."""
        p = r.params
        lg = steer(logits, p, r.n_generated, self.eog)
        if r.matcher is not None:
            lg = r.matcher.apply(lg, mask)
        history = r.counts if r.counts is not None else ()
        if j < len(r.draft):
            tok, ok = verify(lg, p, r.rng, history, r.draft[j])
            self.counters["spec_accepted_tokens"] += ok
        else:
            tok, ok = sample(lg, p, r.rng, history), False
        tlp = top_logprobs(lg, p.top_logprobs, tok) if p.top_logprobs else None
        forced = []  # fed next step, unsampled
        room = min(r.max_tokens - r.n_generated, self.n_ctx - len(r.tokens)) - 1
        if r.matcher is not None and tok not in self.eog:
            r.matcher.consume(tok)
            if not p.top_logprobs:
                forced = r.matcher.forced(room)
        elif r.think is not None and tok not in self.eog:
            forced = r.think.after(tok)[:room]
        return tok, tlp, ok, forced

    @staticmethod
    def score_prompt(r: Request, positions: range, logits: np.ndarray) -> None:
        """Row j predicts the prompt token after position positions[j]: its log-prob (and the k
        most likely alternatives) goes to r.prompt_lps."""
        nxt = np.asarray(r.prompt[positions.start + 1:positions.stop + 1])
        own = logits[np.arange(len(nxt)), nxt].astype(np.float64) - logsumexp_rows(logits[:len(nxt)])
        k = r.prompt_logprobs
        for j, t in enumerate(nxt):
            r.prompt_lps.append((float(own[j]), top_logprobs(logits[j], k, int(t)) if k else None))

    @staticmethod
    def pool(r: Request, h: np.ndarray, *, last: bool) -> str | None:
        """Fold a chunk's hidden states (n, n_embd) into the request's pooled vector; "stop" at
        its last chunk."""
        h = np.asarray(h, np.float64)
        if r.pooling == "mean":
            r.pooled = h.sum(0) + (r.pooled if r.pooled is not None else 0.0)
        elif r.pooling == "cls":
            r.pooled = h[0].copy() if r.pooled is None else r.pooled
        else:  # last
            r.pooled = h[-1].copy()
        if not last:
            return None
        if r.pooling == "mean":
            r.pooled = r.pooled / len(r.tokens)
        return "stop"

    def stats(self) -> dict[str, float]:
        m = self._masks
        return dict(mask_ms_per_token=1e3 * m.compute_s / m.n_masks if m and m.n_masks else 0.0,
                    mask_wait_ms_per_token=1e3 * m.wait_s / m.n_masks if m and m.n_masks else 0.0)

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()
