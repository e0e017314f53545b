"""The model runner (vLLM v1's model runner): a planned batch's inputs (token ids, positions,
KV slots, block tables, recurrent-state slots, output rows), padded to the bucketed shape its
graph is cached by; the forward pass through the graph cache and dispatch; the output rows'
logits, and every token's hidden state where embeddings pool them. It also picks the host
backend's worker threads per step shape, by measuring (runtime.threads). The engine has one
runner; a draft model has its own (runtime.draft). `open_memory` allocates the KV cache (and
recurrent state) that a runner's graphs read and write."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hearthlm.core import layer_memory
from hearthlm.core.errors import HearthError, InvalidRequestError
from hearthlm.core.log import get_logger
from hearthlm.runtime.batch import BatchShape, has_out_row, n_out, scored
from hearthlm.runtime.batcher import StepPlan
from hearthlm.runtime.dispatch import execute
from hearthlm.runtime.graph_cache import FINE_UP_TO, GraphCache, bucket
from hearthlm.runtime.kv_cache import KVCache, kv_layout
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.prompt_cache import PromptCache
from hearthlm.runtime.request import Kind, rope_positions
from hearthlm.runtime.seq_memory import SequenceMemory, StateCache
from hearthlm.runtime.threads import ThreadTuner

log = get_logger("hearthlm.runner")
_LOGITS = frozenset({0})  # the logits' position among a graph's outputs
ENCODER_STEP = 16  # an encoder step's token bucket (its inputs are whole: coarser padding would be all waste)
MIN_KV_BLOCKS = 16  # smallest KV-length bucket of unfused graphs (256 tokens at block size 16)
# a hybrid model's state slots shared by speculating requests for the states after drafted
# positions (one per drafted token in flight; a host's untouched zero pages cost nothing)
ROLLBACK_SLOTS = 16


def _plain_decode(s) -> bool:
    """Whether a scheduled sequence only decodes its next token: one token, its output row, no
    draft, image, scored prompt position or pooled row (runner.inputs' fast path)."""
    r = s.req
    return (s.n_tokens == 1 and not r.draft and not r.media and r.kind is Kind.GENERATE and r.max_tokens > 0
            and s.wants_logits and r.prompt_logprobs is None and not getattr(r.spec, "wants_hidden", False))


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


def open_memory(model: Any, placement: Placement, *, n_ctx: int, kv_blocks: int | None = None,
                block_size: int = 16, max_seqs: int = 64, state_snapshots: int = 8, prompt_cache_dir=None,
                prompt_cache_bytes: int = 1 << 30, kv_cache_type: str = "f16",
                rollback_slots: int = ROLLBACK_SLOTS) -> SequenceMemory:
    """The model's sequence memory: a paged KV cache of at least one context (each layer's K/V
    on the backend that runs its attention), and for a hybrid model (recurrent layers in
    `model.layer_memory`) a state
    slot per running sequence plus `state_snapshots` slots of prefix states, `rollback_slots` for
    speculation (runtime.seq_memory) and a scratch slot.
    With `prompt_cache_dir`, prompt prefixes persist there, keyed by the model file and this
    cache's layout."""
    n_blocks = max(kv_blocks or 0, -(-n_ctx // block_size)) + 1  # + the scratch block
    layers = model.layer_memory  # core.layer_memory: what each layer keeps, as its architecture declares
    kv_dims = layer_memory.kv_dims(layers)
    state_dims = layer_memory.state_dims(layers) if any(m.state for m in layers) else None
    n_state = max_seqs + 1 + state_snapshots + rollback_slots if state_dims else 0  # + the scratch slot
    _check_kv_fits(kv_dims, n_blocks * block_size, placement, state_dims, n_state, kv_cache_type)
    kv = KVCache(kv_dims, n_blocks, block_size, placement.layer_backends(), kv_cache_type)
    state = StateCache(state_dims, n_state, placement.layer_backends()) if state_dims else None
    prompts = None
    if prompt_cache_dir is not None:
        key = dict(model=model.file.identity(), block_size=block_size, state=state_dims,
                   kv=kv.key())  # q8_0 and f16 files never mix
        prompts = PromptCache(prompt_cache_dir, key, block_size=block_size, hybrid=state is not None,
                              max_bytes=prompt_cache_bytes)
    return SequenceMemory(kv, state, n_snapshots=state_snapshots if state_dims else 0,
                          n_rollback=rollback_slots if state_dims else 0, prompts=prompts)


@dataclass
class Picks:
    """Each output row's candidates, taken where the logits are (ModelRunner.run's `picks`)."""
    ids: np.ndarray            # (shape.n_out, k): a greedy row's argmax in column 0, a sampled row's
    #                            top_k ids (ascending) in its first top_k columns
    values: np.ndarray | None  # (shape.n_out, k): their logits; None where every row was greedy
    ok: np.ndarray | None      # (shape.n_out,): False where a sampled row had a NaN; None as values


@dataclass
class StepOutput:
    logits: np.ndarray | None  # (shape.n_out, n_vocab): the output rows (runtime.batch's order), then padding;
    #                            None where the step was asked for picks
    hidden: np.ndarray | None  # (shape.n_tokens, n_embd): every token's final hidden state, where embeddings pool
    picks: Picks | None = None


class ModelRunner:
    def __init__(self, model: Any, placement: Placement, memory: SequenceMemory, *, n_ctx: int,
                 max_batch_tokens: int, max_seqs: int, fusion: bool | None = None, graph_cache: bool = True,
                 weight_cache=None, tune_threads: bool = True, vision=None) -> None:
        """`model` provides build_graph(shape) -> Graph, weights, layer_memory and `causal` (False:
        an encoder, each input whole in one step). `fusion`: None follows HEARTHLM_NO_FUSION;
        `graph_cache=False` rebuilds every step. `weight_cache`: a runtime.weight_cache.WeightCache
        of the model's file, or None. `tune_threads`: pick the host's worker threads per shape
        (a draft model's runner runs on whatever its target's last picked). `vision`: a
        runtime.vision.VisionEncoder, where requests bring images."""
        self.placement, self.memory, self.vision = placement, memory, vision
        self.n_embd = getattr(model, "n_embd_inp", model.config.n_embd) if vision is not None else 0  # rows' width
        self._since_encode = 0.0  # seconds of forward passes since the vision tower's last turn
        self.causal = getattr(model, "causal", True)
        self.n_pos = getattr(model, "n_pos", 1)  # > 1: M-RoPE, position components fed as "rope_pos"
        self.max_blocks = -(-n_ctx // memory.block_size)  # block-table width at most; bucketed per step
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.graphs = GraphCache(memory.kv.typed(model.build_graph), placement, fusion_on=fusion, enabled=graph_cache,
                                 weight_cache=weight_cache)
        self.adapters = getattr(model, "adapters", None)  # model_zoo.adapters.AdapterSet: LoRA chosen per request
        self._lora_keys: tuple[str, ...] = ()  # the live adapters as the last step found them
        # weights packed at load, not at the first step: compiling the single-stream decode graph
        # binds what it reads (a later graph that reads more prepares it on first use)
        self.graphs.prepare(self.shape(n_tokens=1, n_seqs=1, n_out=1, need_blocks=1))
        self.graphs.persist_weights()
        for b in placement.backends.values():
            b.loaded()
        # the host backend's worker threads, chosen per step shape by measuring (runtime.threads)
        self._host = next((b for b in placement.backends.values() if b.thread_counts()), None) \
            if tune_threads else None
        self.threads = ThreadTuner(self._host.thread_counts() if self._host else ())
        # what the backend runs on now (the tuner's last measured count lags it when a step fails)
        self.threads_now = self.threads.current()
        self.worker_moves = 0  # workers moved off a shared core (backends/cpu/affinity.py)

    def run(self, plan: StepPlan, picks: np.ndarray | None = None) -> StepOutput:
        """The forward pass of a planned batch: its output rows' logits (and hidden rows); with
        `picks` (each output row's k, in runtime.batch's order), each row's k largest logits
        instead (1: its argmax), taken where the logits are (Backend.top_k_rows): a device
        copies back k ids and values a row, not a vocabulary of floats."""
        if self.vision is not None:  # the images whose rows this step computes, encoded first
            self.vision.fill([m for s in plan.seqs for m in s.req.media if m.rows is None
                              and m.start < s.req.n_computed + s.n_tokens and m.end > s.req.n_computed])
        feed, shape = self.inputs(plan)
        cg = self.graphs.get(shape)
        n_threads = self.threads.pick(shape)
        if n_threads is not None:
            self._host.use_threads(n_threads)
            self.threads_now = n_threads
        t_run = time.perf_counter()
        outs = execute(cg, feed, self.memory.cache_of, _LOGITS if picks is not None else frozenset())
        chosen = None if picks is None else self._pick(cg.outputs[0][1], outs[0], picks)
        self._since_encode += time.perf_counter() - t_run
        slow = self.threads.done(shape, n_threads, time.perf_counter() - t_run)
        if self._host is not None and self._host.after_step(n_threads, slow):
            self.threads.moved()
            self.worker_moves += 1
        return StepOutput(None if picks is not None else outs[0], outs[1] if shape.embd else None, chosen)

    @staticmethod
    def _pick(backend, logits, ks: np.ndarray) -> Picks:
        """The rows' picks where the logits are: argmax_rows where every row is greedy (k 1), else
        top_k_rows (padding rows: k 0, not computed)."""
        if not len(ks):  # no output row
            return Picks(np.zeros((logits.shape[0], 1), np.int64), None, None)
        if (ks == 1).all():
            return Picks(backend.argmax_rows(logits)[:, None], None, None)
        pad = np.zeros(logits.shape[0], np.int64)
        pad[:len(ks)] = ks
        return Picks(*backend.top_k_rows(logits, pad))

    def encode_images(self, requests: list, running: list) -> list[tuple[Any, HearthError]]:
        """A turn of the tower for the images `requests` wait for, where it is theirs (VisionEncoder.take_turn:
        once the forward passes since the last have taken longer than it); the requests to fail, with
        why, where the tower failed."""
        try:
            if self.vision.take_turn(requests, running, self._since_encode):
                self._since_encode = 0.0
            return []
        except Exception as e:
            log.exception("image encoding failed")
            err = e if isinstance(e, HearthError) else HearthError(f"image encoding failed: {type(e).__name__}: {e}")
            return [(r, err) for r in self.vision.drop_all(requests)]

    def inputs(self, plan: StepPlan) -> tuple[dict[str, np.ndarray], BatchShape]:
        """The step's inputs, padded to the bucketed shape the graph is cached by. Padding
        tokens (id 0, position 0) write K/V into the scratch block and attend from a padding
        sequence row (the scratch block), or row 0 when the rows are full: harmless reads;
        padding output rows repeat row 0 and are ignored."""
        if self.n_pos == 1 and all(_plain_decode(s) for s in plan.seqs):
            return self._decode_inputs(plan)
        bs, scratch = self.memory.block_size, self.memory.scratch_block
        need = max(-(-(s.req.n_computed + s.n_tokens) // bs) for s in plan.seqs)
        media = [(off, s, m) for off, s in zip(np.cumsum([0] + [s.n_tokens for s in plan.seqs]), plan.seqs)
                 for m in s.req.media if m.start < s.req.n_computed + s.n_tokens and m.end > s.req.n_computed]
        n_media = sum(min(m.end, s.req.n_computed + s.n_tokens) - max(m.start, s.req.n_computed) for _, s, m in media)
        shape = self.shape(n_tokens=plan.n_tokens, n_seqs=len(plan.seqs), need_blocks=need,
                           n_out=sum(len(scored(s)) + n_out(s) for s in plan.seqs),
                           embd=any(s.req.kind is Kind.EMBED or getattr(s.req.spec, "wants_hidden", False)
                                    for s in plan.seqs), n_media=n_media,
                           lora=self._lora(plan))
        n_pad, n_seqs, width = shape.n_tokens, shape.n_seqs, shape.max_blocks
        n, n_tok = len(plan.seqs), plan.n_tokens
        # per sequence, gathered in one pass; the arrays are then filled whole (a decode step of 64
        # rows spent ~1.5 ms in a dozen small numpy calls per row)
        ids, blocks, k, done, out_rows = [], [], np.empty(n, np.int32), np.empty(n, np.int32), []
        at = 0
        for i, s in enumerate(plan.seqs):
            r, ki = s.req, s.n_tokens
            c = r.n_computed
            k[i], done[i] = ki, c
            ids.extend((r.tokens + r.draft if r.draft else r.tokens)[c:c + ki])
            blocks.append(r.blocks[:width])
            out_rows.extend(at + q - c for q in scored(s))
            if has_out_row(s):  # a reranking encoder scores its first ([CLS]) token, a decoder its last (and drafts')
                out_rows.extend([at] if r.kind is Kind.RANK and not self.causal
                                else range(at + ki - 1 - len(r.draft), at + ki))
            at += ki
        seq_off = np.full(n_seqs + 1, n_tok, np.int32)  # recurrent layers: each row's token range
        np.cumsum(k[:-1], out=seq_off[1:n])
        seq_off[0] = 0
        of_tok = np.repeat(np.arange(n, dtype=np.int32), k)  # (n_tok,) each token's sequence
        p = done[of_tok] + np.arange(n_tok, dtype=np.int32) - seq_off[of_tok]  # (n_tok,) positions
        tokens, pos = np.zeros(n_pad, np.int32), np.zeros(n_pad, np.int32)  # (n_pad,)
        tokens[:n_tok], pos[:n_tok] = ids, p
        tok_seq = np.full(n_pad, n if n_seqs > n else 0, np.int32)
        tok_seq[:n_tok] = of_tok
        block_table = np.full((n_seqs, width), scratch, np.int32)
        n_blocks = np.fromiter(map(len, blocks), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(blocks), np.int32, int(n_blocks.sum()))
        row_of = np.repeat(np.arange(n), n_blocks)
        block_table[row_of, np.arange(len(flat)) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)] = flat
        slots = scratch * bs + np.arange(n_pad, dtype=np.int32) % bs
        slots[:n_tok] = block_table[of_tok, p // bs] * bs + p % bs
        state_slot = np.zeros(n_seqs, np.int32)  # padding rows: the scratch slot 0
        state_slot[:n] = [s.req.state_slot or 0 for s in plan.seqs]
        snap_slot = np.full(n_pad, -1, np.int32)  # the state after token t also to slot snap_slot[t]
        for i, s in enumerate(plan.seqs):
            for m, slot in s.req.state_snaps.items():  # m tokens computed: after token m - 1
                if s.req.n_computed < m <= s.req.n_computed + s.n_tokens:
                    snap_slot[seq_off[i] + m - 1 - s.req.n_computed] = slot
        seq_len = np.ones(n_pad, np.int32)  # encoders: each token sees its sequence's first seq_len positions
        seq_len[:n_tok] = (done + k)[of_tok]
        rope_pos = np.zeros((n_pad, self.n_pos), np.int32) if self.n_pos > 1 else None
        for i, s in enumerate(plan.seqs):
            r, a = s.req, seq_off[i]
            if r.media:  # an image's placeholder ids (negative) read token 0's row, then replaced
                np.maximum(tokens[a:a + s.n_tokens], 0, out=tokens[a:a + s.n_tokens])
            if rope_pos is not None:  # after an image, no longer the sequence index
                rope_pos[a:a + s.n_tokens] = rope_positions(r.media, r.n_computed, r.n_computed + s.n_tokens, self.n_pos)
        feed = dict(tokens=tokens, pos=pos, tok_seq=tok_seq, slots=slots, block_table=block_table,
                    seq_off=seq_off, state_slot=state_slot, snap_slot=snap_slot, seq_len=seq_len,
                    out_rows=np.asarray(out_rows + [0] * (shape.n_out - len(out_rows)), np.int32))
        if rope_pos is not None:
            feed["rope_pos"] = rope_pos
        if shape.n_media:
            self._media_inputs(feed, shape, media)
        if shape.lora:
            feed["lora_scale"] = self._lora_scales(plan, shape)
        return feed, shape

    def _decode_inputs(self, plan: StepPlan) -> tuple[dict[str, np.ndarray], BatchShape]:
        """inputs() of a step whose every sequence decodes one token (_plain_decode): the same
        arrays from a few whole-array operations. A decode step's inputs took ~0.5 ms of a 13-17 ms
        SmolLM2 step in the general path's per-token bookkeeping (the weights just streamed
        through the caches make each Python and numpy call slow)."""
        bs, scratch = self.memory.block_size, self.memory.scratch_block
        seqs = plan.seqs
        n = len(seqs)
        reqs = [s.req for s in seqs]
        done = [r.n_computed for r in reqs]
        shape = self.shape(n_tokens=n, n_seqs=n, need_blocks=max(done) // bs + 1, n_out=n, lora=self._lora(plan))
        n_pad, n_seqs, width = shape.n_tokens, shape.n_seqs, shape.max_blocks
        # each array from one list (not a dozen numpy calls each): ~35 numpy calls took 0.16 ms of
        # a 5 ms SmolLM2 step on a Zen 4, the weights just through the caches making each slow
        pad, rows = n_pad - n, list(range(n))
        block_table = np.full((n_seqs, width), scratch, np.int32)
        for i, r in enumerate(reqs):
            b = r.blocks[:width]
            block_table[i, :len(b)] = b
        slots = [r.blocks[c // bs] * bs + c % bs for r, c in zip(reqs, done)]
        slots += [scratch * bs + t % bs for t in range(n, n_pad)]
        snaps = [r.state_snaps.get(c + 1, -1) if r.state_snaps else -1 for r, c in zip(reqs, done)]
        feed = dict(tokens=np.array([r.tokens[c] for r, c in zip(reqs, done)] + [0] * pad, np.int32),
                    pos=np.array(done + [0] * pad, np.int32),
                    tok_seq=np.array(rows + [n if n_seqs > n else 0] * pad, np.int32),
                    slots=np.array(slots, np.int32), block_table=block_table,
                    seq_off=np.array(rows + [n] * (n_seqs + 1 - n), np.int32),
                    state_slot=np.array([r.state_slot or 0 for r in reqs] + [0] * (n_seqs - n), np.int32),
                    snap_slot=np.array(snaps + [-1] * pad, np.int32),
                    seq_len=np.array([c + 1 for c in done] + [1] * pad, np.int32),
                    out_rows=np.array(rows + [0] * (shape.n_out - n), np.int32))
        if shape.lora:
            feed["lora_scale"] = self._lora_scales(plan, shape)
        return feed, shape

    def _lora(self, plan: StepPlan) -> tuple[str, ...]:
        """The LoRA adapters the step's graph carries: every live one where a request uses any (so
        that a change of who uses which only rewrites the "lora_scale" input), none otherwise (the
        base graph). Graphs and prepared weights of adapters gone since the last step are dropped."""
        if self.adapters is None:
            return ()
        keys = tuple(sorted(self.adapters.live))
        if keys != self._lora_keys:
            gone = set(self._lora_keys) - set(keys)
            if gone:
                self.graphs.forget(lambda shape: bool(gone & set(shape.lora)),
                                   lambda name: name.rpartition("@")[2] in gone)
            self._lora_keys = keys
        return keys if any(s.req.lora for s in plan.seqs) else ()

    @staticmethod
    def _lora_scales(plan: StepPlan, shape: BatchShape) -> np.ndarray:
        """(n_tokens, adapters) each token's scale per adapter of shape.lora (0: not used; padding: none)."""
        col = {k: i for i, k in enumerate(shape.lora)}
        out, off = np.zeros((shape.n_tokens, len(shape.lora)), np.float32), 0
        for s in plan.seqs:
            for key, scale in s.req.lora:
                out[off:off + s.n_tokens, col[key]] = scale
            off += s.n_tokens
        return out

    def _media_inputs(self, feed: dict, shape: BatchShape, media: list) -> None:
        """Image rows in place of their placeholder tokens (blocks.build_inp_embd), and each
        token's horizon: itself, or for a token of an image attending both ways, its last."""
        rows = np.zeros((shape.n_media, self.n_embd), np.float32)  # row 0 stays zero: the tokens'
        at, text = np.zeros(shape.n_tokens, np.int32), np.ones((shape.n_tokens, 1), np.float32)
        horizon = feed["pos"] + 1
        k = 1
        for off, s, m in media:
            lo, hi = max(m.start, s.req.n_computed), min(m.end, s.req.n_computed + s.n_tokens)
            t = off + lo - s.req.n_computed  # the first of these tokens in the batch
            rows[k:k + hi - lo] = m.rows[lo - m.start:hi - m.start]
            at[t:t + hi - lo] = np.arange(k, k + hi - lo)
            text[t:t + hi - lo] = 0
            if m.bidirectional:
                horizon[t:t + hi - lo] = m.end
            k += hi - lo
        feed.update(media_rows=rows, media_at=at, text_mask=text, seq_len=horizon.astype(np.int32))

    def shape(self, *, n_tokens: int, n_seqs: int, n_out: int, need_blocks: int, embd: bool = False,
              n_media: int = 0, lora: tuple[str, ...] = ()) -> BatchShape:
        """The bucketed shape a step's graph is cached by. KV-length bucket: the fused attention
        reads only up to each token's position, so its graph takes the full width (one bucket);
        the unfused one gathers the whole width."""
        n_seqs_pad = bucket(n_seqs, self.max_seqs)
        width = (self.max_blocks if self.graphs.fused
                 else min(bucket(max(need_blocks, MIN_KV_BLOCKS)), self.max_blocks))
        n_tokens_pad = bucket(n_tokens, self.max_batch_tokens, step=FINE_UP_TO if self.causal else ENCODER_STEP)
        kv = self.memory.kv
        return BatchShape(n_tokens=n_tokens_pad, n_seqs=n_seqs_pad, max_blocks=width,
                          n_out=bucket(n_out, n_seqs_pad if n_out <= n_seqs_pad else n_tokens_pad) if n_out else 0,
                          n_slots=kv.n_slots, block_size=kv.block_size, embd=embd,
                          n_state=self.memory.state.n_slots if self.memory.hybrid else 0,
                          n_media=bucket(n_media + 1) if n_media else 0, lora=lora)

    def stats(self) -> dict[str, Any]:
        """The graph cache's counters, and the worker threads."""
        return dict(self.graphs.stats(), threads=self.threads_now, thread_switches=self.threads.switches,
                    worker_moves=self.worker_moves, **(self.vision.stats() if self.vision is not None else {}))
