"""Decode steps replayed: the CPU backend's counterpart of CUDA graphs (backends/cuda/graphs.py).
Walking a step costs Python at every node: the walk's bookkeeping, then each bound kernel's own
(reshapes, checks, picking a kernel, gathering its arguments), about 300 nodes a token on a
30-layer model. For a compiled graph the kernels called are the same each step, on the same
memory; only the inputs' values change. So the bound kernels route their kernel calls through
`call`, which records them while a step is captured, and later steps call the recorded
kernels directly, the inputs copied into buffers of the replay's own.

A recording replays only once it has shown (else the graph is walked, as before):
- that two consecutive steps made the same calls: the same functions and scalars, and arrays
  over the same memory (owner, address, shape, strides, dtype). A value computed in Python
  from a step's data, or a fresh array, differs between the two;
- that every kernel step made a call (one that made none works outside `call`);
- that the calls alone, run again on the second step's inputs with the planned buffers and the
  outputs' buffers filled with NaN bits, give the walk's outputs bit for bit (work done outside
  `call` leaves NaN or stale values). This runs the step twice, so a graph whose kernels
  update a cache from its own value (a recurrent state) is not replayed; K/V rows written
  again are the same rows.
Each replay then checks that the caches are the arrays recorded, the weights and the arena
too, and keeps a recording per thread count (kernels take the count). Outputs go into their
OutBuffers as the walk's do: a view the caller still holds is never written.
HEARTHLM_CPU_REPLAY=0 turns replay off."""
from __future__ import annotations

import os
import threading
import weakref

import numba
import numpy as np

from hearthlm.core.backend import CACHE, COPY, INPUT, KERNEL
from hearthlm.core.graph import Op
from hearthlm.core.log import get_logger

log = get_logger("hearthlm.cpu")

MAX_TOKENS = 64  # steps of more tokens are the kernels' time: the walk's Python is a few percent
TRIES = 3  # recordings that differ from the one before (a graph whose calls follow its data) before giving up
_REWRITES = frozenset({Op.SET_ROWS, Op.ROPE_SET_ROWS})  # cache writes that write the same rows again alike
_tls = threading.local()
_MARK = object()  # a kernel step's start, in a recording


def enabled() -> bool:
    return os.environ.get("HEARTHLM_CPU_REPLAY", "1") not in ("0", "false", "no", "off")


def call(fn, *args, **kw):
    """fn(*args, **kw), recorded where this thread is capturing a step."""
    calls = getattr(_tls, "calls", None)
    if calls is not None:
        calls.append((fn, args, kw))
    return fn(*args, **kw)


def runner(cg) -> "Replay | None":
    """A Replay for `cg` where replay may apply (a decode-sized step, no copies, no op that
    updates a cache from its own value), else None."""
    if not enabled():
        return None
    tokens = next((st for st in cg.steps if st.kind is INPUT and st.node.name == "tokens"), None)
    if tokens is None or tokens.node.shape[0] > MAX_TOKENS:
        return None
    if any(st.kind is COPY or _updates(st.node.op.props) and st.node.op not in _REWRITES for st in cg.steps):
        return None
    return Replay(cg)


def _updates(props) -> bool:
    """Whether an op writes a cache in place: the check that runs a step twice must not update
    a recurrent state twice."""
    return props.writes_cache or props.updates_state


def _owner(a: np.ndarray):
    """What owns an array's memory: the ndarray at the end of its chain of bases, or a
    non-numpy owner (an mmap)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else a.base


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Recording:
    """One step's calls, and what they say about memory: each array argument as the memory it
    covers, the outputs' buffers (OutBuffers) as positions to rebuild at each replay."""

    def __init__(self, calls: list, outs: list, pools: list) -> None:
        self.calls = calls
        self.outs = outs
        owners = {id(p.buf): k for k, p in enumerate(pools) if p is not None and p.buf is not None}
        self.pooled = owners
        self.bases = {k: _addr(p.buf) for k, p in enumerate(pools) if p is not None and p.buf is not None}
        self.desc = [self._call_desc(c) for c in calls]
        self.out_desc = [self._desc(v) for v in outs]

    def _desc(self, v):
        if isinstance(v, np.ndarray):
            own = _owner(v)
            k = self.pooled.get(id(own))
            if k is not None:  # an output's buffer: which one, and where in it
                return ("pool", k, _addr(v) - self.bases[k], v.shape, v.strides, v.dtype)
            return ("mem", own, _addr(v), v.shape, v.strides, v.dtype)
        if v is None or isinstance(v, (bool, int, float, str, np.generic)):
            return ("val", type(v), v)
        return ("obj", v)

    def _call_desc(self, c):
        fn, args, kw = c
        return fn, tuple(self._desc(a) for a in args), tuple((k, self._desc(v)) for k, v in sorted(kw.items()))

    def same(self, other: "_Recording") -> bool:
        """The same calls over the same memory (owners compared by identity)."""
        if len(self.desc) != len(other.desc) or len(self.out_desc) != len(other.out_desc):
            return False
        for a, b in zip(self.desc, other.desc):
            if a[0] is not b[0] or len(a[1]) != len(b[1]) or len(a[2]) != len(b[2]):
                return False
            pairs = list(zip(a[1], b[1])) + [(x[1], y[1]) for x, y in zip(a[2], b[2]) if x[0] == y[0]]
            if len(pairs) != len(a[1]) + len(a[2]) or not all(_same(x, y) for x, y in pairs):
                return False
        return all(_same(x, y) for x, y in zip(self.out_desc, other.out_desc))


def _same(x, y) -> bool:
    if x[0] != y[0]:
        return False
    if x[0] == "mem":
        return x[1] is y[1] and x[2:] == y[2:]
    if x[0] == "obj":
        return x[1] is y[1]
    if x[0] == "val":
        return x[1] is y[1] and (x[2] == y[2] or x[2] != x[2] and y[2] != y[2])  # NaN: itself
    return x == y


class _Program:
    """A checked recording, as the calls to make: arguments in an output's buffer rebuilt from
    the buffer its OutBuffer hands out for the step, the others as recorded."""

    def __init__(self, rec: _Recording) -> None:
        self.steps = []  # (fn, args, kw, patches): patches (where, key, pool, offset, shape, strides, dtype)
        for (fn, args, kw), (_f, dargs, dkw) in zip(rec.calls, rec.desc):
            fn = _entry(fn, args, kw)
            patches = [("a", i, *d[1:]) for i, d in enumerate(dargs) if d[0] == "pool"]
            patches += [("k", k, *d[1:]) for k, d in dkw if d[0] == "pool"]
            if patches:  # the recorded views go: they would hold the buffer (OutBuffer counts holders)
                args = tuple(None if d[0] == "pool" else a for a, d in zip(args, dargs))
                kw = {k: (None if d[0] == "pool" else kw[k]) for k, d in dkw}
            self.steps.append((fn, args, kw, patches))
        self.outs = [(None, d) if d[0] == "pool" else (v, None) for v, d in zip(rec.outs, rec.out_desc)]

    def run(self, bufs: list) -> list:
        """The calls, outputs into `bufs` (per output position: its OutBuffer's buffer, or None)."""
        for fn, args, kw, patches in self.steps:
            if patches:
                args, kw = list(args), dict(kw)
                for where, key, k, off, shape, strides, dtype in patches:
                    v = np.ndarray(shape, dtype, buffer=bufs[k], offset=off, strides=strides)
                    if where == "a":
                        args[key] = v
                    else:
                        kw[key] = v
            fn(*args, **kw)
        return [v if d is None else np.ndarray(d[3], d[5], buffer=bufs[d[1]], offset=d[2], strides=d[4])
                for v, d in self.outs]


def _entry(fn, args: tuple, kw: dict):
    """The compiled entry point of numba dispatcher `fn` for exactly these arguments' types, where
    it has one: a replayed call then skips the dispatcher's typing of every argument (~0.6 of
    1.3 us a call, ~300 calls a decode step); else fn itself (not a dispatcher, keywords, or an
    overload the dispatcher would reach by converting). The recorded arguments' types hold at
    every replay: the same arrays' dtype, shape and strides, the same scalars."""
    overloads = getattr(fn, "overloads", None)
    if overloads is None or kw:
        return fn
    try:
        sig = tuple(fn.typeof_pyval(a) for a in args)
    except Exception:  # a value numba does not type: the dispatcher says so at the call
        return fn
    cres = overloads.get(sig)
    return fn if cres is None else cres.entry_point


class Replay:
    """cg.runner for the CPU backend: walks (and records) the first steps of each thread count,
    replays once a recording has passed the checks in the module's docstring."""

    def __init__(self, cg) -> None:
        # weakly: cg.runner is this, and a cycle would keep the graph's weights (a closed model's
        # mapped file) until the cyclic collector ran
        self._cg = weakref.ref(cg)
        self.inputs = [(st.index, st.node.name) for st in cg.steps if st.kind is INPUT]
        self.cache_nodes = [st.node for st in cg.steps if st.kind is CACHE]
        self.out_steps = [cg.steps[j] for j, _b in cg.outputs]
        self.planned = next((st for st in cg.steps if st.kind is KERNEL and st.out is not None), None)
        self.bufs: dict[int, np.ndarray] | None = None  # the inputs' buffers, by node index
        self.by_threads: dict[int, dict] = {}  # thread count -> state (uses, last recording, program, key)
        self.counters = dict(captures=0, replays=0, declined=0)

    @property
    def cg(self):
        return self._cg()

    def _key(self, cache_of) -> tuple:
        arena = _owner(self.planned.out) if self.planned is not None else None
        return (tuple(cache_of(n) for n in self.cache_nodes), self.cg.statics, arena)

    def __call__(self, feed, cache_of, keep=frozenset()):
        n = numba.get_num_threads()
        s = self.by_threads.get(n)
        if s is None:
            s = self.by_threads[n] = dict(uses=0, rec=None, prog=None, key=None, tries=0, failed=False)
        s["uses"] += 1
        if s["failed"] or s["uses"] == 1:
            return None  # the first step walks as it is: kernels compile
        if s["prog"] is not None:
            key = self._key(cache_of)
            if _same_key(key, s["key"]) and self._load(feed):
                return self._replay(s["prog"], keep)
            s["prog"] = s["rec"] = None  # caches, weights or arena changed: record again
        return self._capture(s, feed, cache_of, keep)

    def _load(self, feed) -> bool:
        for i, name in self.inputs:
            x, b = feed[name], self.bufs[i]
            if x.shape != b.shape or x.dtype != b.dtype:
                return False  # not the recorded shape (the graph cache keys on it: should not happen)
            np.copyto(b, x)
        return True

    def _takes(self) -> list:
        return [None if st.pool is None else st.pool.take(st.node.shape, st.node.dtype).base for st in self.out_steps]

    def _replay(self, prog: _Program, keep):
        outs = prog.run(self._takes())
        self.counters["replays"] += 1
        return outs

    def _capture(self, s: dict, feed, cache_of, keep):
        """This step walked with its kernels' calls recorded (its outputs are the step's); the
        recording compared with the last one, and where alike checked by running it."""
        cg = self.cg
        if self.bufs is None:
            self.bufs = {i: np.array(feed[name]) for i, name in self.inputs}
        elif not self._load(feed):
            return None
        calls: list = []
        kernels = [st for st in cg.steps if st.kind is KERNEL]
        fns = [st.fn for st in kernels]
        for st, fn in zip(kernels, fns):
            st.fn = _marked(fn, calls)
        _tls.calls = calls
        try:
            outs = cg.walk(feed, cache_of, self.bufs)
        finally:
            _tls.calls = None
            for st, fn in zip(kernels, fns):
                st.fn = fn
        self.counters["captures"] += 1
        key = self._key(cache_of)
        why = _each_kernel_called(calls, len(kernels))
        rec = None
        if why is None:
            rec = _Recording([c for c in calls if c is not _MARK], outs, [st.pool for st in self.out_steps])
            last, s["rec"] = s["rec"], rec
            if last is None or not _same_key(key, s["key"]):
                s["key"] = key
                return outs
            if not rec.same(last):
                why = "the calls differ from one step to the next"
            else:
                why = self._check(rec, outs)
        if why is None:
            s["prog"], s["rec"] = _Program(rec), None  # the recording's views of the outputs would hold their buffers
            log.debug("cpu_replay", tokens=len(feed["tokens"]), calls=len(rec.calls))
            return outs
        s["tries"] += 1
        if why != "the calls differ from one step to the next" or s["tries"] >= TRIES:
            s["failed"], s["rec"] = True, None  # a recording's calls hold arrays: none kept for a graph that walks
            self.counters["declined"] += 1
            log.debug("cpu_replay_declined", tokens=len(feed["tokens"]), why=why)
        return outs

    def _check(self, rec: _Recording, outs: list) -> str | None:
        """The recording run again on this step's inputs, the planned buffers and the outputs'
        filled with NaN bits: the walk's outputs bit for bit, or why not."""
        arena = _owner(self.planned.out) if self.planned is not None else None
        if any(isinstance(v, np.ndarray) and _owner(v) is arena for v in outs):
            return "an output lies in the arena"
        if isinstance(arena, np.ndarray):
            arena.view(np.uint8).fill(0xFF)
        bufs = self._takes()  # new buffers: `outs` holds the ones the walk wrote
        for b in bufs:
            if b is not None:
                b.fill(0xFF)
        again = _Program(rec).run(bufs)
        for a, b in zip(outs, again):
            if not isinstance(a, np.ndarray) or a.shape != b.shape or a.dtype != b.dtype:
                return "an output differs in kind"
            if a.tobytes() != np.asarray(b).tobytes():
                return "the recorded calls alone give other outputs"
        return None


def _marked(fn, calls: list):
    def k(*args, **kw):
        calls.append(_MARK)
        return fn(*args, **kw)
    return k


def _each_kernel_called(calls: list, n_kernels: int) -> str | None:
    marks = [i for i, c in enumerate(calls) if c is _MARK]
    if len(marks) != n_kernels:
        return "a kernel step ran other than once"
    for a, b in zip(marks, marks[1:] + [len(calls)]):
        if b == a + 1:
            return "a kernel step made no recorded call"
    return None


def _same_key(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return False
    caches_a, statics_a, arena_a = a
    caches_b, statics_b, arena_b = b
    return (statics_a is statics_b and arena_a is arena_b and len(caches_a) == len(caches_b)
            and all(x is y for x, y in zip(caches_a, caches_b)))
