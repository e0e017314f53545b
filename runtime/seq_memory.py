"""Sequence memory: what a sequence keeps between steps, behind one interface the batcher and
engine use for every model. Attention layers keep K/V in the paged KV cache (runtime.kv_cache);
the recurrent layers of hybrid models (Qwen3.5's Gated DeltaNet, LFM2's short convolution,
Granite 4.0-H's Mamba-2) keep a fixed-size state per sequence in a slot of the StateCache.

Prefix reuse never gives a wrong state: a recurrent state summarizes every token before it, so
cached KV blocks are reused only up to a boundary where a snapshot of the state was taken after
exactly those tokens. A snapshot is taken at the last block boundary of each prompt (the batcher
ends a prefill chunk there), kept in a bounded number of snapshot slots (least recently used
goes first) and dropped with the KV block it ends at (vLLM's hybrid cache manager, llama.cpp's
llama_memory_hybrid). Anything else is recomputed.

Speculative decoding computes drafted tokens that may be rejected: the K/V of a rejected one is
simply overwritten later, but a recurrent state has moved past it. So a speculating request
reserves rollback slots first (`reserve_rollback`): the recurrent kernels copy the state after
each drafted position there as they run the verification rows (their `snap_slot` input, filled
by the runner from `req.state_snaps`), and `rollback(req, n)` then makes the state the one after
exactly n tokens, as plain decoding would have left it (vLLM's per-position Mamba states for
speculation; llama.cpp's server keeps a few per-position states per sequence, llama_n_rs_seq, and
past them restores a checkpoint taken before the step and replays the kept tokens)."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from hearthlm.core.backend import Backend
from hearthlm.core.graph import Tensor
from hearthlm.runtime.kv_cache import KVCache, block_hash
from hearthlm.runtime.prompt_cache import PromptCache, digests
from hearthlm.runtime.request import Request

KV_NAMES = ("cache_k", "cache_v")


def _root(req: Request) -> int | None:
    """The parent hash of a request's first block: its LoRA adapters' (keys and scales), so that only
    requests with the same adapter set share prefix blocks; None for the base model."""
    return hash(("lora", req.lora)) if req.lora else None


class StateCache:
    """Per recurrent layer, one array per state kind (`dims[il]`: name -> per-slot shape, e.g.
    {"state_conv": (K-1, C), "state_ssm": (H, d_v, d_k)}), each of n_slots slots, float32, on
    the backend that runs the layer. Slot 0 is scratch: padding rows of a batch point at it."""

    def __init__(self, dims: list[dict[str, tuple[int, ...]]], n_slots: int, backends: list[Backend]) -> None:
        assert len(dims) == len(backends) and n_slots >= 2
        self.n_slots = n_slots
        self.backends = backends
        self.arrays: dict[tuple[str, int], Any] = {
            (name, il): be.zeros((n_slots, *shape), np.dtype(np.float32))
            for il, (be, d) in enumerate(zip(backends, dims)) for name, shape in d.items()}
        self._free = list(range(n_slots - 1, 0, -1))  # pop() hands out the lowest first

    @staticmethod
    def bytes_per_slot(dims: list[dict[str, tuple[int, ...]]]) -> int:
        return sum(4 * int(np.prod(s)) for d in dims for s in d.values())

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        for a in self.arrays.values():
            a[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        for a in self.arrays.values():  # numpy and cupy alike
            a[dst] = a[src]


class SequenceMemory:
    """The KV blocks and state slot of each sequence: taken at admission (or the request
    waits), grown as it computes, released on finish, cancel, timeout, preemption or fault."""

    def __init__(self, kv: KVCache, state: StateCache | None = None, *, n_snapshots: int = 0,
                 n_rollback: int = 0, prompts: PromptCache | None = None) -> None:
        """`n_snapshots`: state slots of prompt-prefix snapshots; `n_rollback`: state slots that
        speculating requests share for the states after their drafted positions."""
        self.kv = kv
        self.state = state
        self.prompts = prompts  # persisted prefixes on disk, or None
        self.block_size = kv.block_size
        self.scratch_block = kv.allocator.alloc(1)[0]  # padding tokens write here; no sequence reads it
        # block hash -> snapshot slot: the state after the tokens up to the end of that block
        self._snaps: OrderedDict[int, int] = OrderedDict()
        self._snap_free = [state.alloc() for _ in range(n_snapshots)] if state is not None else []
        if None in self._snap_free:
            raise ValueError(f"{n_snapshots} snapshots do not fit {state.n_slots} state slots")
        self.n_snapshots = len(self._snap_free)
        self._rollback_free = [state.alloc() for _ in range(n_rollback)] if state is not None else []
        if None in self._rollback_free:
            raise ValueError(f"{n_rollback} rollback slots do not fit {state.n_slots} state slots")
        self.n_rollback = len(self._rollback_free)
        kv.allocator.on_drop = _weakly(self._drop_snapshot)  # no cycle: the KV arrays go when the engine does
        self.reused_tokens = 0  # prompt tokens taken from the prefix cache instead of computed
        self.snapshots_taken = 0

    @property
    def hybrid(self) -> bool:
        return self.state is not None

    # ---- the batcher's side -------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Before a waiting request first runs: its cached prefix (where reuse is exact) and its
        state slot. False (nothing held) when no slot is free: it waits."""
        if self.state is not None and req.state_slot is None:
            slot = self.state.alloc()
            if slot is None:
                return False
            req.state_slot = slot
        # embeddings pool every token and scored prompts want every token's logits: none reused
        if not req.blocks and not req.pooling and req.prompt_logprobs is None:
            self.reused_tokens += self._reuse_prefix(req)
        if self.state is not None and req.n_computed == 0:
            self.state.zero(req.state_slot)
        return True

    def grow(self, req: Request, n_tokens: int) -> bool:
        """Make sure req owns blocks for its first n_tokens tokens."""
        need = self.kv.blocks_for(n_tokens) - len(req.blocks)
        if need <= 0:
            return True
        got = self.kv.allocator.alloc(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def chunk_end(self, req: Request) -> int:
        """Where this request's next chunk must stop at the latest: for a hybrid model, the last
        block boundary of its prompt (a snapshot is taken there), else its end."""
        b = self._snapshot_boundary(req)
        return b if b is not None and req.n_computed < b else req.n_total

    def release(self, req: Request) -> None:
        """Free the request's blocks and slot; it would recompute from scratch (prefix cache permitting)."""
        self.kv.allocator.free(req.blocks)
        self._free_rollback(req)
        if req.state_slot is not None:
            self.state.free(req.state_slot)
        req.blocks, req.block_hashes, req.n_computed, req.state_slot = [], [], 0, None

    def unadmit(self, req: Request) -> None:
        """Admission could not go through (no blocks): give back what admit took."""
        self.reused_tokens -= req.n_computed
        self.release(req)

    # ---- speculation: rolling back past rejected drafts -------------------------------------
    def reserve_rollback(self, req: Request, positions: range) -> int:
        """Before a step that computes tokens speculatively: a slot for the request's state after
        each of `positions` tokens (ascending), which the step's recurrent kernels fill as they
        pass there, so that rollback() can return to any of them. Returns how many positions (a
        prefix of them) got one: all where the model has no recurrent state, fewer when the shared
        rollback slots run short (the caller drafts less). Earlier reservations are given back."""
        self._free_rollback(req)
        if self.state is None:
            return len(positions)
        for p in positions:
            if not self._rollback_free:
                break
            req.state_snaps[p] = self._rollback_free.pop()
        return len(req.state_snaps)

    def rollback(self, req: Request, n: int) -> int:
        """The request keeps its first n computed tokens (n <= n_computed): the K/V past them is
        left to be overwritten, and a recurrent state goes back to the one after n tokens (a slot
        reserve_rollback gave, whose index becomes the request's; its old slot goes to the pool).
        Where no slot holds that state, the request starts again from nothing (a bug upstream;
        correct, only slower). Gives back every rollback slot; returns the new n_computed."""
        # blocks past n must not be findable by later prompts: they are to be rewritten
        assert len(req.block_hashes) * self.block_size <= n <= req.n_computed, (n, req.n_computed)
        if self.state is not None and n < req.n_computed:
            slot = req.state_snaps.pop(n, None)
            if slot is None:
                n = 0
                self.state.zero(req.state_slot)
            else:
                req.state_slot, req.state_snaps[n] = slot, req.state_slot
        self._free_rollback(req)
        req.n_computed = n
        return n

    def _free_rollback(self, req: Request) -> None:
        self._rollback_free.extend(req.state_snaps.values())
        req.state_snaps.clear()

    # ---- the engine's side --------------------------------------------------------------
    def after_step(self, req: Request) -> None:
        """Make the request's newly completed blocks findable by later prompts, and snapshot its
        state where it stands at its prompt's last block boundary."""
        bs, alloc = self.block_size, self.kv.allocator
        while len(req.block_hashes) < req.n_computed // bs:
            i = len(req.block_hashes)
            h = block_hash(req.block_hashes[-1] if i else _root(req), req.tokens[i * bs:(i + 1) * bs])
            alloc.register(req.blocks[i], h)
            req.block_hashes.append(h)
        if self.n_snapshots and req.n_computed == self._snapshot_boundary(req) and not req.pooling:
            self._snapshot(req)

    def cache_of(self, node: Tensor):
        if node.name in KV_NAMES:
            return self.kv.cache_of(node)
        return self.state.arrays[(node.name, node.layer)]

    def stats(self) -> dict[str, Any]:
        st = dict(kv_blocks_used=self.kv.allocator.n_used - 1, kv_blocks_total=self.kv.n_blocks - 1,  # less scratch
                  kv_cache_bytes=sum(int(a.nbytes) for a in [*self.kv.k, *self.kv.v]),  # pages taken as first written
                  kv_cache_type=self.kv.kv_type, kv_bytes_per_token=self.kv.bytes_per_token,
                  prefix_cache_hit_tokens=self.reused_tokens)
        if self.prompts is not None:
            st.update(self.prompts.stats())
        if self.state is not None:
            total = self.state.n_slots - 1 - self.n_snapshots - self.n_rollback  # less scratch, snapshots, rollback
            st.update(state_slots_used=total - self.state.n_free, state_slots_total=total,
                      state_cache_bytes=self.state.nbytes, state_snapshots=len(self._snaps),
                      state_snapshots_taken=self.snapshots_taken,
                      state_rollback_slots_used=self.n_rollback - len(self._rollback_free))
        return st

    # ---- prefix reuse -------------------------------------------------------------------
    def _snapshot_boundary(self, req: Request) -> int | None:
        if self.state is None:
            return None
        b = (len(req.prompt) - 1) // self.block_size * self.block_size
        return b or None

    def _reuse_prefix(self, req: Request) -> int:
        """Take cached blocks for the request's leading full blocks; returns the tokens reused.
        At least one token is left to compute: its logits are needed. A hybrid model stops at
        the longest run of cached blocks that ends at a snapshot, and starts from its state."""
        bs, alloc = self.block_size, self.kv.allocator
        h = _root(req)
        for i in range((len(req.tokens) - 1) // bs):
            h = block_hash(h, req.tokens[i * bs:(i + 1) * bs])
            b = alloc.take_cached(h)
            if b is None:
                break
            req.blocks.append(b)
            req.block_hashes.append(h)
        if self.state is not None:
            keep = next((j for j in range(len(req.blocks), 0, -1) if req.block_hashes[j - 1] in self._snaps), 0)
            alloc.free(req.blocks[keep:])
            del req.blocks[keep:], req.block_hashes[keep:]
            if keep:
                snap = self._snaps[req.block_hashes[-1]]
                self._snaps.move_to_end(req.block_hashes[-1])
                self.state.copy(snap, req.state_slot)
        if self.prompts is not None and not req.lora:  # files on disk are keyed by tokens alone
            self._load_persisted(req)
        cut = next((m.start for m in req.media if m.bidirectional and m.start < len(req.blocks) * bs < m.end), None)
        if cut is not None and self.state is None:  # an image attending both ways is reused only whole
            alloc.free(req.blocks[cut // bs:])
            del req.blocks[cut // bs:], req.block_hashes[cut // bs:]
        req.n_computed = len(req.blocks) * bs
        return req.n_computed

    # ---- persisted prefixes -------------------------------------------------------------
    def _load_persisted(self, req: Request) -> None:
        """Extend the request's cached blocks from a persisted prefix longer than what memory
        held: its K/V written into fresh blocks (registered for later prompts) and, for a
        hybrid model, its state at the file's end."""
        bs, alloc, have = self.block_size, self.kv.allocator, len(req.blocks)
        n_max = (len(req.tokens) - 1) // bs
        if n_max <= have:
            return
        hit = self.prompts.longest(digests(req.tokens, bs, n_max))
        if hit is None or hit[1] <= have:
            return
        path, n = hit
        got = alloc.alloc(n - have)
        if got is None:  # no room now: computed instead
            return
        arrays = self.prompts.load(path, n)
        try:
            if arrays is None:
                raise LookupError
            slots, rows = self.kv.slots_of(got), slice(have * bs, n * bs)
            for il, be in enumerate(self.kv.backends):
                for name, cache in (("k", self.kv.k), ("v", self.kv.v)):
                    a = arrays[f"{name}{il}"][rows]
                    if a.shape[1:] != cache[il].shape[1:] or a.dtype != cache[il].dtype:
                        raise ValueError(f"{name}{il}: {a.dtype}{a.shape} for {cache[il].dtype}{cache[il].shape}")
                    cache[il][slots] = be.from_host(np.ascontiguousarray(a))
            if self.state is not None:
                for (name, il), a in self.state.arrays.items():
                    a[req.state_slot] = self.state.backends[il].from_host(np.ascontiguousarray(arrays[f"{name}/{il}"]))
        except LookupError:
            alloc.free(got)
            return
        except (KeyError, ValueError) as e:  # a file whose arrays do not fit this cache
            alloc.free(got)
            self.prompts.discard(path, f"does not fit: {e}")
            return
        h = req.block_hashes[-1] if have else None
        for i, b in enumerate(got, have):
            h = block_hash(h, req.tokens[i * bs:(i + 1) * bs])
            alloc.register(b, h)
            req.blocks.append(b)
            req.block_hashes.append(h)
        if self.state is not None and self.n_snapshots:
            self._snapshot(req)  # the next prompt with this prefix finds it in memory

    def persist(self, req: Request) -> int:
        """Write the computed prompt's full blocks (a hybrid model's: up to its state snapshot)
        to the prompt cache; the tokens written (0: none)."""
        bs = self.block_size
        if self.prompts is None or req.n_computed < len(req.prompt) or req.lora:
            return 0
        if self.state is not None:
            b = self._snapshot_boundary(req)
            snap = self._snaps.get(req.block_hashes[b // bs - 1]) if b else None
            if snap is None:
                return 0
            n = b // bs
        else:
            n = len(req.prompt) // bs
        if n == 0:
            return 0
        slots = self.kv.slots_of(req.blocks[:n])
        arrays = {f"{name}{il}": be.to_host(cache[il][slots]) for il, be in enumerate(self.kv.backends)
                  for name, cache in (("k", self.kv.k), ("v", self.kv.v))}
        if self.state is not None:
            arrays.update({f"{name}/{il}": self.state.backends[il].to_host(a[snap])
                           for (name, il), a in self.state.arrays.items()})
        return n * bs if self.prompts.save(req.tokens[:n * bs], arrays) else 0

    def _snapshot(self, req: Request) -> None:
        h = req.block_hashes[-1]
        if h in self._snaps:
            self._snaps.move_to_end(h)
            return
        if not self._snap_free:  # the least recently used goes
            self._snap_free.append(self._snaps.popitem(last=False)[1])
        slot = self._snap_free.pop()
        self.state.copy(req.state_slot, slot)
        self._snaps[h] = slot
        self.snapshots_taken += 1

    def _drop_snapshot(self, h: int) -> None:
        """The KV block registered under h is being overwritten: its snapshot goes with it."""
        slot = self._snaps.pop(h, None)
        if slot is not None:
            self._snap_free.append(slot)


def _weakly(method):
    """A bound method that does not keep its object alive (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        if m is not None:
            m(*args)
    return call
