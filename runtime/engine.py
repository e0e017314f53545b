"""The engine: one worker thread, the only one that runs kernels, repeating `step()` = plan ->
run -> process -> update (vLLM v1's schedule / execute / update): the batcher plans which
requests advance (runtime.batcher), the model runner computes their output rows
(runtime.runner), the output processor turns those into tokens, pooled vectors and finishes
(runtime.output), and the update delivers them and frees what finished. Requests join and
leave at any step; callers talk to it through `submit` / `abort` (thread-safe) and the
request's callbacks."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import threadpoolctl
from threadpoolctl import threadpool_limits

from hearthlm.core.errors import ContextLengthError, EngineFailedError, HearthError, InvalidRequestError, QueueFull, SessionClosedError
from hearthlm.core.log import get_logger
from hearthlm.runtime.batcher import Batcher, StepPlan
from hearthlm.runtime.draft_heads import new_spec, observe
from hearthlm.runtime.output import Outcome, OutputProcessor
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Kind, Request, check_media
from hearthlm.runtime.runner import ROLLBACK_SLOTS, ModelRunner, open_memory
from hearthlm.runtime.speculative import NgramDrafter
from hearthlm.runtime.vision import VisionEncoder

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


class Engine:
    def __init__(self, model: Any, placement: Placement | Any, *, n_ctx: int, kv_blocks: int | None = None,
                 block_size: int = 16, max_batch_tokens: int = 512, max_seqs: int = 64,
                 max_queued_requests: int = 1024, fusion: bool | None = None, graph_cache: bool = True,
                 weight_cache=None, state_snapshots: int = 8, prompt_cache_dir=None,
                 prompt_cache_bytes: int = 1 << 30, kv_cache_type: str = "f16", draft=None, vision=None,
                 image_cache_bytes: int = 256 << 20, after_callbacks: Callable[[], None] | None = None,
                 rollback_slots: int = ROLLBACK_SLOTS,
                 mtp=None) -> None:
        """`model` provides build_graph(shape) -> Graph, weights, layer_memory, n_vocab, eog_ids.
        `placement`: a runtime.placement.Placement of layers over backends, or one backend
        (the trivial placement). `fusion`: None follows HEARTHLM_NO_FUSION; `graph_cache=False`
        rebuilds every step. `weight_cache`: a runtime.weight_cache.WeightCache of the model's file
        (packed weights mapped from disk, written there when packed afresh), or None.
        A hybrid model (`model.state_dims`: per layer, its recurrent state's shapes) gets a state
        slot per running sequence, `state_snapshots` slots of prefix states and `rollback_slots`
        for speculating requests' states after drafted positions (runtime.seq_memory).
        `prompt_cache_dir`: where persisted prompt prefixes are kept (runtime.prompt_cache), at
        most prompt_cache_bytes of them, keyed by the model file (`model.file.identity()`) and
        this cache's layout; None for none. `kv_cache_type`: the K/V element type (core.kv_types).
        `draft`: a runtime.draft.DraftModel, which then drafts for every request that does not
        ask otherwise (SamplingParams.speculative None; "off" opts out). `vision`: a vision tower
        (runtime.vision.VisionEncoder's `tower`) for requests with images, run where the output head
        is; its rows are kept in an LRU of image_cache_bytes. `after_callbacks`: called on the engine
        thread after each round of request callbacks (a step's, an abort's, a failure's): sdk's _wake.flush.
        `mtp`: a runtime.draft_heads.MTPDrafter of the model's own MTP block, for speculative="mtp"."""
        self.model = model
        self.n_ctx = n_ctx
        self.max_queued_requests = max_queued_requests
        self.placement = (placement if isinstance(placement, Placement)
                          else Placement.single(placement, len(model.layer_memory)))
        self.memory = open_memory(model, self.placement, n_ctx=n_ctx, kv_blocks=kv_blocks, block_size=block_size,
                                  max_seqs=max_seqs, state_snapshots=state_snapshots,
                                  prompt_cache_dir=prompt_cache_dir, prompt_cache_bytes=prompt_cache_bytes,
                                  kv_cache_type=kv_cache_type, rollback_slots=rollback_slots)
        self.kv = self.memory.kv
        # an encoder (model.causal False) attends over each input whole: one step computes all of it
        self.causal = getattr(model, "causal", True)
        if draft is not None and not self.causal:
            raise InvalidRequestError("this model is an encoder: it does not generate, so nothing is drafted for it")
        self.draft, self.mtp = draft, mtp
        if hasattr(draft, "attach"):  # a head drafter (runtime.draft_heads) runs on this engine's memory
            draft.attach(self.memory, self.placement, n_ctx=n_ctx, max_seqs=max_seqs, fusion=fusion)
        self.batcher = Batcher(self.memory, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                               whole=not self.causal)
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.runner = ModelRunner(model, self.placement, self.memory, n_ctx=n_ctx, max_batch_tokens=max_batch_tokens,
                                  max_seqs=max_seqs, fusion=fusion, graph_cache=graph_cache, weight_cache=weight_cache,
                                  vision=vision and VisionEncoder.beside(vision, self.placement, image_cache_bytes, fusion))
        self.graphs = self.runner.graphs
        self.output = OutputProcessor(model.n_vocab, model.eog_ids, n_ctx)
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: set[int] = set()
        self._closing: str | None = None  # None, "finish" or "abort"
        self._failed: HearthError | None = None  # set when the loop itself broke: nothing runs any more
        self._thread: threading.Thread | None = None
        self._after_callbacks = after_callbacks
        self.counters = dict(steps=0, tokens_computed=0, step_time_s=0.0, preemptions=0)

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
        if req.kind is Kind.DRAFT:
            raise InvalidRequestError("a draft request is run by its draft model (runtime.draft), not submitted")
        if not self.causal:  # an encoder: embeddings only, each input in one step
            if not req.kind.pools:
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
        how = req.params.speculative or ("draft" if self.draft is not None and req.kind is Kind.GENERATE else None)
        if how in ("draft", "mtp"):  # the session's draft model, or the model's own MTP block
            req.spec = new_spec(how, self.draft, self.mtp)
        if req.media:
            check_media(req, self.runner.vision is not None, mrope=self.runner.n_pos > 1)
        bad = [t for i, t in enumerate(req.prompt) if not 0 <= t < self.model.n_vocab and not req.in_media(i)]
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
        self.output.close()

    def health(self) -> dict[str, Any]:
        """ok: the engine takes and runs requests; else `error` says why not."""
        alive = self._thread is not None and self._thread.is_alive()
        error = str(self._failed) if self._failed else None if alive or self._thread is None else "stopped"
        return dict(ok=error is None and not self._closing, error=error, closing=bool(self._closing))

    def stats(self) -> dict[str, Any]:
        # requests counted in the order they move, then the memory (_finish frees it first)
        with self._cv:
            queued, running = len(self._incoming) + len(self.waiting), len(self.running)
        c = dict(self.counters, **self.output.counters, **self.memory.stats())  # + KV blocks, state slots, prefix hits
        ttft = sorted(self.output.ttft)
        c.update(
            queue_depth=queued, running_requests=running,
            tokens_per_s=c["tokens_generated"] / c["step_time_s"] if c["step_time_s"] else 0.0,
            time_to_first_token_s=ttft[len(ttft) // 2] if ttft else None)
        c.update(self.runner.stats())  # graph cache hits/misses, nodes unfused/fused, build/reuse times; threads
        c.update(self.output.stats())  # grammar masks' time per token
        for d in (self.draft, self.mtp):  # a draft model's (or assistant's) counts; the MTP block's
            c.update(d.stats() if d is not None else {})
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
        _after_round(self._after_callbacks)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._aborts or self.running or self.waiting or self._closing):
                    self._cv.wait()
                self.waiting.extend(self._incoming)
                self._incoming.clear()
                aborts, self._aborts = self._aborts, set()
                closing = self._closing
            try:
                self._drop(aborts, "abort")
                if closing == "abort":
                    self._drop({r.id for r in [*self.running, *self.waiting]}, "closed")
                if closing and not (self.running or self.waiting):
                    return
                self.step()
            finally:  # the round's callbacks have all been made
                _after_round(self._after_callbacks)

    def _drop(self, ids: set[int], reason: str) -> None:
        for req in [r for r in [*self.running, *self.waiting] if r.id in ids]:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        try:  # memory first: stats() (another thread) never sees no requests but their blocks still held
            if req.spec is not None and not isinstance(req.spec, NgramDrafter):
                getattr(req.spec, "drafter", self.draft).release(req.spec)
            self.batcher.release(req)
        finally:  # the caller hears of it even if releasing broke (then the loop fails the rest)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            try:
                req.on_finish(reason, error)
            except Exception:  # the caller's callback: the request is finished all the same
                log.exception("on_finish callback failed", request=req.id)

    def _draft(self) -> None:
        """Draft tokens for the speculating requests that are decoding (their last token is the
        only one left to compute); a grammar keeps only the prefix it accepts."""
        drafting, by_model = [], {}
        for r in self.running:
            if r.spec is None or r.n_wanted != 1 or r.draft:
                continue
            room = min(r.max_tokens - r.n_generated, self.n_ctx - len(r.tokens)) - 1
            if isinstance(r.spec, NgramDrafter):
                r.draft = r.spec.propose(r.tokens, room)
            else:  # the session's draft model, or the model's own heads
                by_model.setdefault(getattr(r.spec, "drafter", self.draft), []).append((r, room))
            drafting.append(r)
        for drafter, items in by_model.items():
            try:  # all of them in batched steps of the draft model
                drafter.propose(items)
            except Exception:  # drafts only save time: without them the step goes on as usual
                log.exception("the draft model failed; this step runs without drafts")
                for r, _ in items:
                    r.draft = []
        for r in drafting:
            if r.draft and r.matcher is not None:
                r.draft = r.draft[:r.matcher.valid_prefix(r.draft)]
            if r.draft:  # a recurrent state's rollback points: after the last token and each draft but the last
                del r.draft[self.memory.reserve_rollback(r, range(len(r.tokens), len(r.tokens) + len(r.draft))):]

    def step(self) -> None:
        """plan -> run -> process -> update: the batcher plans which requests advance (after
        drafting for those that speculate), the runner computes their output rows, the output
        processor makes them tokens, pooled vectors and finishes, the update delivers those."""
        t0 = time.perf_counter()
        if self.runner.vision is not None:  # images waiting for their rows: their share of the step
            for r, err in self.runner.encode_images([*self.running, *self.waiting], self.running):
                self._finish(r, "error", err)
        plan = self._plan()
        if plan is None or not plan.seqs:
            return
        try:
            job = self.output.start_masks(plan)  # constrained rows' masks are filled while the forward pass runs
            try:
                out = self.runner.run(plan, self.output.picks(plan))
                observe(plan, out.hidden, self.draft, self.mtp)  # the rows head drafters start from
            finally:  # the matchers are not touched again before their masks are done
                masks = self.output.join_masks(job)
            # counted before the update wakes the callers, so their stats() see this step
            self.counters["steps"] += 1
            self.counters["tokens_computed"] += plan.n_tokens
            self._update(plan, self.output.process(plan, out, masks))
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

    def _plan(self) -> StepPlan | None:
        """Drafts, then the batcher's plan; None where planning failed (and with it every
        request it considered)."""
        self._draft()
        try:
            plan = self.batcher.plan(self.running, self.waiting)
        except Exception as e:  # which request caused it is unknown: fail all it considered
            log.exception("engine planning failed")
            err = HearthError(f"the engine could not plan a step: {type(e).__name__}: {e}")
            for r in [*self.running, *self.waiting]:
                self._finish(r, "error", err)
            return None
        self.counters["preemptions"] += len(plan.preempted)
        return plan

    def _update(self, plan: StepPlan, outcomes: list[Outcome]) -> None:
        """Each request keeps the K/V of its computed tokens (less a rejected draft's), its full
        blocks findable by later prompts; its new tokens are delivered; what finished is released."""
        for s, o in zip(plan.seqs, outcomes):
            r, drafted = s.req, len(s.req.draft)
            r.n_computed += s.n_tokens
            if drafted or r.state_snaps:  # rejected drafts' rows dropped: K/V overwritten later, a state rolled back
                self.memory.rollback(r, r.n_computed - drafted + (o.kept if o.finish is None else 0))
            if not r.kind.pools:  # an embedding's or a ranking's blocks are not cached
                self.memory.after_step(r)  # blocks findable by later prompts; a state snapshot
            finish, error = _deliver(o)
            if finish == "stop" and r.kind is Kind.PREFILL:
                r.persisted = self.memory.persist(r)
            if drafted:
                r.spec.feedback(drafted, o.kept if finish is None else 0)
                r.draft = []
            if finish is not None:
                self._finish(r, finish, error)


def _deliver(o: Outcome) -> tuple[str | None, BaseException | None]:
    """The step's tokens to the request's callback, in order; one that raises fails its own
    request only. Returns how the request finishes, if it does."""
    try:
        for t, lp in o.tokens:
            o.req.on_token(t, lp)
    except Exception as e:
        return "error", HearthError(f"token callback failed: {type(e).__name__}: {e}")
    return o.finish, o.error


def _after_round(hook: Callable[[], None] | None) -> None:
    """The engine's after_callbacks, where there is one; one that raises is logged, the engine goes on."""
    if hook is not None:
        try:
            hook()
        except Exception:
            log.exception("after_callbacks failed")
