"""The engine: one worker thread, the only one that runs kernels, repeating
`step()` = plan -> graph -> dispatch -> sample -> update. Requests join and leave at any
step; callers talk to it through `submit` / `abort` (thread-safe) and the request's
callbacks."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np
import threadpoolctl
from threadpoolctl import threadpool_limits

from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.batcher import Batcher, StepPlan
from hearthlm.runtime.constraint import GrammarError, MaskWorker
from hearthlm.runtime.dispatch import CompiledGraph, execute
from hearthlm.core.errors import (ContextLengthError, EngineFailedError, HearthError, InvalidRequestError,
                                     QueueFull, SessionClosedError)
from hearthlm.runtime.graph_cache import FINE_UP_TO, GraphCache, bucket
from hearthlm.runtime.kv_cache import KVCache, kv_layout
from hearthlm.core.log import get_logger
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.prompt_cache import PromptCache
from hearthlm.runtime.request import Request
from hearthlm.runtime.seq_memory import SequenceMemory, StateCache
from hearthlm.runtime.speculative import NgramDrafter
from hearthlm.runtime.sampling import log_softmax_rows, sample, steer, top_logprobs, verify
from hearthlm.runtime.threads import ThreadTuner

log = get_logger("hearthlm.engine")
_blas = {"engines": 0, "limit": None}
_blas_lock = threading.Lock()


def _blas_single_threaded(delta: int) -> None:
    """BLAS limited to one thread while any engine runs; the first engine to start takes the
    limit and the last to close restores the application's setting."""
    with _blas_lock:
        _blas["engines"] += delta
        if delta > 0 and _blas["engines"] == 1:
            _blas["limit"] = threadpool_limits(limits=1, user_api="blas")
            _release_blas_control()
        elif delta < 0 and _blas["engines"] == 0:
            _blas["limit"].restore_original_limits()
            _blas["limit"] = None
            _release_blas_control()


def _release_blas_control() -> None:
    """threadpoolctl (3.8+) lets only the thread that last set OpenBLAS's thread count set it
    again, the others silently doing nothing, until that thread lets go: engines start from any
    thread (a session's from a worker thread), so each lets go after its change."""
    ctl = getattr(threadpoolctl, "OpenBLASController", None)
    if ctl is not None and hasattr(ctl, "clear_controlling_thread"):
        ctl.clear_controlling_thread()
def _check_kv_fits(kv_dims: list[tuple[int, int]], n_slots: int, placement: Placement,
                   state_dims: list[dict] | None = None, n_state: int = 0, kv_type: str = "f16") -> None:
    """Refuse at open a KV cache (and recurrent state) that its backends cannot hold (a host's
    zeroed pages are only taken when written: it would fail much later, mid-generation, out of memory)."""
    need: dict[str, int] = {}
    layout = kv_layout(kv_type, kv_dims, [placement.backends[name] for name in placement.layers])
    for il, ((row, dt), name) in enumerate(zip(layout, placement.layers)):
        need[name] = need.get(name, 0) + 2 * n_slots * int(np.prod(row)) * dt.itemsize
        if state_dims:
            need[name] += n_state * StateCache.bytes_per_slot([state_dims[il]])
    for name, n in need.items():
        avail = placement.backends[name].memory_available()
        if avail is not None and n > avail:
            what = f"{n_slots} token slots" + (f", {n_state} recurrent-state slots" if state_dims else "")
            raise InvalidRequestError(
                f"the KV cache ({what}) needs {n / 2**30:.2f} GiB on {name}, where "
                f"{avail / 2**30:.2f} GiB is available: lower n_ctx, kv_cache_tokens or max_seqs")


ENCODER_STEP = 16  # an encoder step's token bucket (its inputs are whole: coarser padding would be all waste)
MIN_KV_BLOCKS = 16  # smallest KV-length bucket of unfused graphs (256 tokens at block size 16)


def _out_row(s) -> bool:
    """Whether this step computes the request's output row: generations at their last token, and
    a reranker's scored token; embeddings pool hidden states and need none (no LM head for them),
    nor does a prompt scored without generating."""
    return s.wants_logits and (s.req.pooling == "rank" or (not s.req.pooling and s.req.max_tokens > 0))


def _n_out(s) -> int:
    """Output rows this step computes for the request: its last token's, and one per draft token."""
    return (1 + len(s.req.draft)) if _out_row(s) else 0


def _scored(s) -> range:
    """Positions of this chunk whose logits score the next prompt token (prompt_logprobs)."""
    r = s.req
    if r.prompt_logprobs is None:
        return range(0)
    lo = max(r.n_computed, len(r.prompt_lps))  # a recomputation (after preemption) scores nothing twice
    return range(lo, max(lo, min(r.n_computed + s.n_tokens, len(r.prompt) - 1)))


class Engine:
    def __init__(self, model: Any, placement: Placement | Any, *, n_ctx: int, kv_blocks: int | None = None,
                 block_size: int = 16, max_batch_tokens: int = 512, max_seqs: int = 64,
                 max_queued_requests: int = 1024, fusion: bool | None = None, graph_cache: bool = True,
                 weight_cache=None, state_snapshots: int = 8, prompt_cache_dir=None,
                 prompt_cache_bytes: int = 1 << 30, kv_cache_type: str = "f16", draft=None) -> None:
        """`model` provides build_graph(shape) -> Graph, weights, kv_dims, n_vocab, eog_ids.
        `placement`: a runtime.placement.Placement of layers over backends, or one backend
        (the trivial placement). `fusion`: None follows HEARTHLM_NO_FUSION; `graph_cache=False`
        rebuilds every step. `weight_cache`: a runtime.weight_cache.WeightCache of the model's file
        (packed weights mapped from disk, written there when packed afresh), or None.
        A hybrid model (`model.state_dims`: per layer, its recurrent state's shapes) gets a state
        slot per running sequence and `state_snapshots` slots of prefix states.
        `prompt_cache_dir`: where persisted prompt prefixes are kept (runtime.prompt_cache), at
        most prompt_cache_bytes of them, keyed by the model file (`model.file.identity()`) and
        this cache's layout; None for none. `kv_cache_type`: the K/V element type (core.kv_types).
        `draft`: a runtime.draft.DraftModel, which then drafts for every request that does not
        ask otherwise (SamplingParams.speculative None; "off" opts out)."""
        self.model = model
        self.n_ctx = n_ctx
        self.max_queued_requests = max_queued_requests
        self.placement = (placement if isinstance(placement, Placement)
                          else Placement.single(placement, len(model.kv_dims)))
        # each layer's K/V lives on the backend that runs its attention
        blocks_per_seq = -(-n_ctx // block_size)
        n_blocks = max(kv_blocks or 0, blocks_per_seq) + 1
        state_dims = getattr(model, "state_dims", None)
        state_dims = state_dims if state_dims and any(state_dims) else None
        n_state = max_seqs + 1 + state_snapshots if state_dims else 0  # + the scratch slot
        _check_kv_fits(model.kv_dims, n_blocks * block_size, self.placement, state_dims, n_state, kv_cache_type)
        self.kv = KVCache(model.kv_dims, n_blocks, block_size, self.placement.layer_backends(), kv_cache_type)
        state = StateCache(state_dims, n_state, self.placement.layer_backends()) if state_dims else None
        prompts = None
        if prompt_cache_dir is not None:
            key = dict(model=model.file.identity(), block_size=block_size, state=state_dims,
                       kv=self.kv.key())  # q8_0 and f16 files never mix
            prompts = PromptCache(prompt_cache_dir, key, block_size=block_size, hybrid=state is not None,
                                  max_bytes=prompt_cache_bytes)
        self.memory = SequenceMemory(self.kv, state, n_snapshots=state_snapshots if state_dims else 0,
                                     prompts=prompts)
        self.scratch_block = self.memory.scratch_block
        # an encoder (model.causal False) attends over each input whole: one step computes all of it
        self.causal = getattr(model, "causal", True)
        if draft is not None and (state is not None or not self.causal):
            raise InvalidRequestError("a draft model needs a target whose layers all keep a KV cache: "
                                      "a recurrent state cannot be rolled back past rejected drafts")
        self.draft = draft
        self.batcher = Batcher(self.memory, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                               whole=not self.causal)
        self.max_blocks = blocks_per_seq  # block-table width at most; bucketed per step (the KV-length bucket)
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.graphs = GraphCache(self.kv.typed(model.build_graph), self.placement, fusion_on=fusion,
                                 enabled=graph_cache, weight_cache=weight_cache)
        # weights packed at load, not at the first step: compiling the single-stream decode graph
        # binds what it reads (a later graph that reads more prepares it on first use)
        self.graphs.prepare(self._shape(n_tokens=1, n_seqs=1, n_out=1, need_blocks=1))
        self.graphs.persist_weights()
        for b in self.placement.backends.values():
            b.loaded()
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: set[int] = set()
        self._closing: str | None = None  # None, "finish" or "abort"
        self._failed: HearthError | None = None  # set when the loop itself broke: nothing runs any more
        self._thread: threading.Thread | None = None
        self.counters = dict(steps=0, tokens_computed=0, tokens_generated=0, step_time_s=0.0,
                             preemptions=0, spec_drafted_tokens=0, spec_accepted_tokens=0,
                             worker_moves=0)  # workers moved off a shared core (backends/cpu/affinity.py)
        self._ttft: deque[float] = deque(maxlen=1000)
        self._masks: MaskWorker | None = None  # started with the first constrained request
        # the host backend's worker threads, chosen per step shape by measuring (runtime.threads)
        self._host = next((b for b in self.placement.backends.values() if b.thread_counts()), None)
        self.threads = ThreadTuner(self._host.thread_counts() if self._host else ())
        # what the backend runs on now (the tuner's last measured count lags it when a step fails)
        self._threads_now = self.threads.current()

    # ---- caller side (any thread) -------------------------------------------------
    def start(self) -> None:
        # OpenBLAS's own threads spin after each call and fight numba's for the cores (a
        # 512-token Gemma prefill: 9.7 s with them, 2.4 s without): BLAS runs single-threaded
        # while the engine runs. Process-wide, restored by close().
        _blas_single_threaded(+1)
        self._thread = threading.Thread(target=self._loop, name="hearthlm-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if not self.causal:  # an encoder: embeddings only, each input in one step
            if not req.pooling:
                raise InvalidRequestError("this model is an encoder: it embeds and ranks, it does not generate")
            if n > min(self.n_ctx, self.max_batch_tokens):
                raise ContextLengthError(f"the input has {n} tokens; the encoder takes at most "
                                         f"{min(self.n_ctx, self.max_batch_tokens)}")
        elif n > self.n_ctx - (req.max_tokens > 0):  # lengths first: the vocabulary check is a pass over the ids
            raise ContextLengthError(f"the prompt has {n} tokens; the context holds {self.n_ctx} "
                                     + ("(prompt plus at least one generated token)" if req.max_tokens else ""))
        if n + req.max_tokens > self.n_ctx:
            raise ContextLengthError(f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                                     f"context of {self.n_ctx} tokens")
        kind = req.params.speculative or ("draft" if self.draft is not None and not req.pooling else None)
        if kind == "draft":
            if self.draft is None:
                raise InvalidRequestError("speculative='draft' needs a session opened with draft_model=")
            req.spec = self.draft.new_seq()
        if req.spec is not None and (self.memory.hybrid or not self.causal):
            raise InvalidRequestError("speculative decoding needs a model whose layers all keep a KV cache: "
                                      "a recurrent state cannot be rolled back past rejected drafts")
        bad = [t for t in req.prompt if not 0 <= t < self.model.n_vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        with self._cv:
            if self._failed is not None:
                raise EngineFailedError(str(self._failed))
            if self._closing:
                raise SessionClosedError("the session is closed")
            if len(self._incoming) + len(self.waiting) >= self.max_queued_requests:
                raise QueueFull(f"{self.max_queued_requests} requests are already queued")
            req.arrival = time.perf_counter()
            self._incoming.append(req)
            self._cv.notify()

    def abort(self, req_id: int) -> None:
        with self._cv:
            self._aborts.add(req_id)
            self._cv.notify()

    def close(self, *, abort: bool = False) -> None:
        with self._cv:
            self._closing = "abort" if abort else "finish"
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            _blas_single_threaded(-1)
        if self._masks is not None:
            self._masks.close()

    def health(self) -> dict[str, Any]:
        """ok: the engine takes and runs requests; else `error` says why not."""
        alive = self._thread is not None and self._thread.is_alive()
        error = str(self._failed) if self._failed else None if alive or self._thread is None else "stopped"
        return dict(ok=error is None and not self._closing, error=error, closing=bool(self._closing))

    def stats(self) -> dict[str, Any]:
        c = dict(self.counters, **self.memory.stats())  # KV blocks, state slots, prefix-cache hits
        ttft = sorted(self._ttft)
        c.update(
            queue_depth=len(self.waiting) + len(self._incoming), running_requests=len(self.running),
            tokens_per_s=c["tokens_generated"] / c["step_time_s"] if c["step_time_s"] else 0.0,
            time_to_first_token_s=ttft[len(ttft) // 2] if ttft else None)
        c.update(self.graphs.stats())  # graph_cache_hits/misses, graph_nodes_unfused/fused, build/reuse times
        m = self._masks
        c.update(mask_ms_per_token=1e3 * m.compute_s / m.n_masks if m and m.n_masks else 0.0,
                 mask_wait_ms_per_token=1e3 * m.wait_s / m.n_masks if m and m.n_masks else 0.0)
        c.update(threads=self._threads_now, thread_switches=self.threads.switches)
        if self.draft is not None:
            c.update(self.draft.stats())
        c.update(healthy=self._failed is None, engine_error=str(self._failed) if self._failed else None)
        return c

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            for b in self.placement.backends.values():  # kernels run in this thread
                b.bind_thread()
            self._serve()
        except BaseException as e:  # outside any one step's guard: nothing more can run
            self._fail_everything(e)

    def _fail_everything(self, e: BaseException) -> None:
        """Every pending request, and every later submit, fails at once with the reason."""
        log.error("engine failed", error=f"{type(e).__name__}: {e}", exc_info=e)
        err = EngineFailedError(f"the engine stopped after an internal error: {type(e).__name__}: {e}")
        with self._cv:
            self._failed = err
            pending = [*self.running, *self.waiting, *self._incoming]
            self.running, self.waiting, self._incoming = [], deque(), []
        for req in pending:
            try:
                req.on_finish("error", err)
            except Exception:  # the caller's callback; the others still get theirs
                log.exception("on_finish callback failed")

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._aborts or self.running or self.waiting or self._closing):
                    self._cv.wait()
                self.waiting.extend(self._incoming)
                self._incoming.clear()
                aborts, self._aborts = self._aborts, set()
                closing = self._closing
            self._drop(aborts, "abort")
            if closing == "abort":
                self._drop({r.id for r in [*self.running, *self.waiting]}, "closed")
            if closing and not (self.running or self.waiting):
                return
            self.step()

    def _drop(self, ids: set[int], reason: str) -> None:
        for req in [r for r in [*self.running, *self.waiting] if r.id in ids]:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        try:
            if self.draft is not None and req.spec is not None and not isinstance(req.spec, NgramDrafter):
                self.draft.release(req.spec)
            self.batcher.release(req)
        finally:  # the caller hears of it even if releasing broke (then the loop fails the rest)
            try:
                req.on_finish(reason, error)
            except Exception:  # the caller's callback: the request is finished all the same
                log.exception("on_finish callback failed", request=req.id)

    def _draft(self) -> None:
        """Draft tokens for the speculating requests that are decoding (their last token is the
        only one left to compute); a grammar keeps only the prefix it accepts."""
        drafting, by_model = [], []
        for r in self.running:
            if r.spec is None or r.n_wanted != 1 or r.draft:
                continue
            room = min(r.max_tokens - r.n_generated, self.n_ctx - len(r.tokens)) - 1
            if isinstance(r.spec, NgramDrafter):
                r.draft = r.spec.propose(r.tokens, room)
            else:
                by_model.append((r, room))
            drafting.append(r)
        if by_model:
            try:  # all of them in batched steps of the draft model
                self.draft.propose(by_model)
            except Exception:  # drafts only save time: without them the step goes on as usual
                log.exception("the draft model failed; this step runs without drafts")
                for r, _ in by_model:
                    r.draft = []
        for r in drafting:
            if r.draft and r.matcher is not None:
                r.draft = r.draft[:r.matcher.valid_prefix(r.draft)]

    def step(self) -> None:
        """plan -> graph -> dispatch -> sample -> update."""
        t0 = time.perf_counter()
        self._draft()
        try:
            plan = self.batcher.plan(self.running, self.waiting)
        except Exception as e:  # which request caused it is unknown: fail all it considered
            log.exception("engine planning failed")
            err = HearthError(f"the engine could not plan a step: {type(e).__name__}: {e}")
            for r in [*self.running, *self.waiting]:
                self._finish(r, "error", err)
            return
        self.counters["preemptions"] += len(plan.preempted)
        if not plan.seqs:
            return
        try:
            feed, shape = self._assemble(plan)
            # constrained rows' masks are filled while the forward pass runs
            constrained = [s.req for s in plan.seqs if s.wants_logits and s.req.matcher is not None]
            if constrained and self._masks is None:
                self._masks = MaskWorker(self.model.n_vocab)
            job = self._masks.start([r.matcher for r in constrained], [r.draft for r in constrained]) \
                if constrained else None
            try:
                cg = self._graph(shape)
                n_threads = self.threads.pick(shape)
                if n_threads is not None:
                    self._host.use_threads(n_threads)
                    self._threads_now = n_threads
                t_run = time.perf_counter()
                outs = execute(cg, feed, self.memory.cache_of)
                slow = self.threads.done(shape, n_threads, time.perf_counter() - t_run)
                if self._host is not None and self._host.after_step(n_threads, slow):
                    self.threads.moved()
                    self.counters["worker_moves"] += 1
            finally:  # the matchers are not touched again before their masks are done
                masks = self._masks.join(job) if job else None
            # counted before _update wakes the callers, so their stats() see this step
            self.counters["steps"] += 1
            self.counters["tokens_computed"] += plan.n_tokens
            at = np.cumsum([0] + [1 + len(r.draft) for r in constrained])  # each one's mask rows
            self._update(plan, outs[0], {id(r): masks[at[i]:at[i + 1]] for i, r in enumerate(constrained)}
                         if job else {}, outs[1] if shape.embd else None)
        except Exception as e:  # a bug or a kernel failure: fail this batch, keep serving
            log.exception("engine step failed")
            err = e if isinstance(e, HearthError) else HearthError(f"engine step failed: {type(e).__name__}: {e}")
            for s in plan.seqs:
                if s.req in self.running:
                    self._finish(s.req, "error", err)
        dt = time.perf_counter() - t0
        self.counters["step_time_s"] += dt
        log.debug("step", seqs=len(plan.seqs), tokens=plan.n_tokens, queue=len(self.waiting),
                  kv_used=self.kv.allocator.n_used, ms=round(dt * 1e3, 2))

    def forward(self, plan: StepPlan) -> np.ndarray:
        """The plan's output rows' logits, nothing sampled or updated (a draft model's steps)."""
        feed, shape = self._assemble(plan)
        return execute(self._graph(shape), feed, self.memory.cache_of)[0]

    def _assemble(self, plan: StepPlan) -> tuple[dict[str, np.ndarray], BatchShape]:
        """The step's inputs, padded to the bucketed shape the graph is cached by. Padding
        tokens (id 0, position 0) write K/V into the scratch block and attend from a padding
        sequence row (the scratch block), or row 0 when the rows are full: harmless reads;
        padding output rows repeat row 0 and are ignored."""
        bs = self.kv.block_size
        out_wanted = sum(len(_scored(s)) + _n_out(s) for s in plan.seqs)
        need = max(-(-(s.req.n_computed + s.n_tokens) // bs) for s in plan.seqs)
        shape = self._shape(n_tokens=plan.n_tokens, n_seqs=len(plan.seqs), n_out=out_wanted, need_blocks=need,
                            embd=any(s.req.pooling and s.req.pooling != "rank" for s in plan.seqs))
        n_pad, n_seqs, width = shape.n_tokens, shape.n_seqs, shape.max_blocks
        tokens, pos = np.zeros(n_pad, np.int32), np.zeros(n_pad, np.int32)
        tok_seq = np.full(n_pad, len(plan.seqs) if n_seqs > len(plan.seqs) else 0, np.int32)
        slots = self.scratch_block * bs + np.arange(n_pad, dtype=np.int32) % bs
        block_table = np.full((n_seqs, width), self.scratch_block, np.int32)
        # recurrent layers: each row's token range, and its state slot (padding rows: empty, scratch slot 0)
        seq_off, state_slot = np.full(n_seqs + 1, plan.n_tokens, np.int32), np.zeros(n_seqs, np.int32)
        seq_len = np.ones(n_pad, np.int32)  # encoders: each token sees its sequence's first seq_len positions
        out_rows, off = [], 0
        for i, s in enumerate(plan.seqs):
            r, k = s.req, s.n_tokens
            p = np.arange(r.n_computed, r.n_computed + k, dtype=np.int32)
            blocks = np.asarray(r.blocks[:width], np.int32)
            tokens[off:off + k] = (r.tokens + r.draft if r.draft else r.tokens)[r.n_computed:r.n_computed + k]
            pos[off:off + k] = p
            tok_seq[off:off + k] = i
            slots[off:off + k] = blocks[p // bs] * bs + p % bs
            block_table[i, :len(blocks)] = blocks
            seq_off[i], state_slot[i] = off, r.state_slot or 0
            seq_len[off:off + k] = r.n_computed + k
            out_rows.extend(off + q - r.n_computed for q in _scored(s))
            if _out_row(s):  # a reranking encoder scores its first ([CLS]) token, a decoder its last (and drafts')
                out_rows.extend([off] if r.pooling == "rank" and not self.causal
                                else range(off + k - 1 - len(r.draft), off + k))
            off += k
        feed = dict(tokens=tokens, pos=pos, tok_seq=tok_seq, slots=slots, block_table=block_table,
                    seq_off=seq_off, state_slot=state_slot, seq_len=seq_len,
                    out_rows=np.asarray(out_rows + [0] * (shape.n_out - len(out_rows)), np.int32))
        return feed, shape

    def _shape(self, *, n_tokens: int, n_seqs: int, n_out: int, need_blocks: int, embd: bool = False) -> BatchShape:
        """The bucketed shape a step's graph is cached by. KV-length bucket: the fused attention
        reads only up to each token's position, so its graph takes the full width (one bucket);
        the unfused one gathers the whole width."""
        n_seqs_pad = bucket(n_seqs, self.max_seqs)
        width = (self.max_blocks if self.graphs.fused
                 else min(bucket(max(need_blocks, MIN_KV_BLOCKS)), self.max_blocks))
        n_tokens_pad = bucket(n_tokens, self.max_batch_tokens, step=FINE_UP_TO if self.causal else ENCODER_STEP)
        return BatchShape(n_tokens=n_tokens_pad, n_seqs=n_seqs_pad, max_blocks=width,
                          n_out=bucket(n_out, n_seqs_pad if n_out <= n_seqs_pad else n_tokens_pad) if n_out else 0, n_slots=self.kv.n_slots,
                          block_size=self.kv.block_size, embd=embd,
                          n_state=self.memory.state.n_slots if self.memory.hybrid else 0)

    def _graph(self, shape: BatchShape) -> CompiledGraph:
        """Built, fused and planned once per bucketed shape; later steps only rewrite inputs."""
        return self.graphs.get(shape)

    def _update(self, plan: StepPlan, logits: np.ndarray, masks: dict[int, np.ndarray],
                hidden: np.ndarray | None = None) -> None:
        row = off = 0
        now = time.perf_counter()
        for s in plan.seqs:
            r, first = s.req, off
            off += s.n_tokens
            scored = _scored(s)
            if scored:
                self._score_prompt(r, scored, logits[row:row + len(scored)])
                row += len(scored)
            drafted = len(r.draft)
            r.n_computed += s.n_tokens - drafted  # a draft's rows count once they are kept
            if r.pooling == "rank":  # a reranker's score: the head's output at the scored row
                if s.wants_logits:
                    r.pooled = np.array(logits[row], np.float64)
                    row += 1
                    self._finish(r, "stop")
                continue
            if r.pooling:  # an embedding: pools this chunk's rows (no output row), no blocks cached
                self._pool(r, hidden[first:off])
                continue
            self.memory.after_step(r)  # blocks findable by later prompts; a state snapshot
            if not s.wants_logits:
                continue
            if r.max_tokens == 0:  # a prompt scored or cached, nothing generated
                if r.persist:
                    r.persisted = self.memory.persist(r)
                self._finish(r, "stop")
                continue
            self.counters["spec_drafted_tokens"] += drafted  # counted before callers are woken
            kept = self._emit(r, logits[row:row + 1 + drafted], masks.get(id(r)), now)
            row += 1 + drafted
            if drafted:
                r.spec.feedback(drafted, max(kept, 0))
                r.draft = []
                if kept > 0:
                    self.memory.after_step(r)

    def _emit(self, r: Request, rows: np.ndarray, masks: np.ndarray | None, now: float) -> int:
        """Sample the request's next token from rows[0], or, where it drafted, verify its draft
        along the rows (row j follows draft token j-1) and emit the tokens kept plus the one the
        target chose after them. Returns the draft tokens kept (-1: the request finished)."""
        p, eog, draft = r.params, self.model.eog_ids, r.draft
        for j in range(len(rows)):
            try:
                lg = steer(rows[j], p, r.n_generated, eog)
                if r.matcher is not None:
                    lg = r.matcher.apply(lg, masks[j])
                history = r.counts if r.counts is not None else ()
                if j < len(draft):
                    tok, ok = verify(lg, p, r.rng, history, draft[j])
                    self.counters["spec_accepted_tokens"] += ok  # counted before callers are woken
                else:
                    tok, ok = sample(lg, p, r.rng, history), False
                tlp = top_logprobs(lg, p.top_logprobs, tok) if p.top_logprobs else None
                ff = []  # tokens the grammar (or a reasoning budget) forces after tok: fed next step, unsampled
                room = min(r.max_tokens - r.n_generated, self.n_ctx - len(r.tokens)) - 1
                if r.matcher is not None and tok not in eog:
                    r.matcher.consume(tok)
                    if not p.top_logprobs:
                        ff = r.matcher.forced(room)
                elif r.think is not None and tok not in eog:
                    ff = r.think.after(tok)[:room]
            except GrammarError as e:  # this request's grammar, not its neighbours'
                self._finish(r, "error", e)
                return -1
            except Exception as e:  # this request's sampling, not its neighbours'
                self._finish(r, "error", HearthError(f"sampling failed: {type(e).__name__}: {e}"))
                return -1
            if r.first_token_at is None:
                r.first_token_at = now
                self._ttft.append(now - r.arrival)
            if (tok in eog and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(r, "stop")
                return -1
            try:
                for t, lp in [(tok, tlp), *((t, None) for t in ff)]:
                    r.append(t)
                    r.n_generated += 1
                    self.counters["tokens_generated"] += 1
                    r.on_token(t, lp)
            except Exception as e:  # the caller's callback fails its own request only
                self._finish(r, "error", HearthError(f"token callback failed: {type(e).__name__}: {e}"))
                return -1
            if r.matcher is not None and r.matcher.done:  # only end-of-generation could follow
                self._finish(r, "stop")
                return -1
            if r.n_generated >= r.max_tokens or len(r.tokens) >= self.n_ctx:
                self._finish(r, "length")
                return -1
            if not ok or ff:  # the target chose otherwise (or forced tokens come next): the rest is dropped
                return j
            r.n_computed += 1  # the kept draft token's K/V were computed in this step
        return len(draft)

    @staticmethod
    def _score_prompt(r: Request, positions: range, logits: np.ndarray) -> None:
        """Row j predicts the prompt token after position positions[j]: its log-prob (and the k
        most likely alternatives) goes to r.prompt_lps."""
        lp = log_softmax_rows(logits)
        nxt = np.asarray(r.prompt[positions.start + 1:positions.stop + 1])
        own = lp[np.arange(len(nxt)), nxt]
        k = r.prompt_logprobs
        for j, t in enumerate(nxt):
            r.prompt_lps.append((float(own[j]), top_logprobs(logits[j], k, int(t)) if k else None))

    def _pool(self, r: Request, h: np.ndarray) -> None:
        """Fold a chunk's hidden states (n, n_embd) into the request's pooled vector; at its
        last token the request finishes (and its KV blocks are freed)."""
        h = np.asarray(h, np.float64)
        if r.pooling == "mean":
            r.pooled = h.sum(0) + (r.pooled if r.pooled is not None else 0.0)
        elif r.pooling == "cls":
            r.pooled = h[0].copy() if r.pooled is None else r.pooled
        else:  # last
            r.pooled = h[-1].copy()
        if r.n_computed == len(r.tokens):
            if r.pooling == "mean":
                r.pooled = r.pooled / len(r.tokens)
            self._finish(r, "stop")
