"""Decode against the memory roofline: a decode step reads every weight it uses once, and the
K/V of every earlier token, so tokens/s can be at most (read bandwidth) / (bytes per token).
`hearthlm bench` reports decode tokens/s as a fraction of that, for hearthlm (its packed
weights, as the decode graph binds them) and for llama.cpp (the GGUF's own tensors); of stacked
experts, the chosen ones."""
from __future__ import annotations

import numpy as np


def _nbytes(v) -> int:
    """A prepared weight's bytes (a backend's packed layout, or an array)."""
    if isinstance(v, np.ndarray):
        return v.nbytes
    n = getattr(v, "nbytes", 0)
    return int(n() if callable(n) else n)


def read_bytes(node, v) -> int:
    """What a kernel reads of a prepared weight: all of it, or of stacked experts (one prepared weight
    each, a backend's tuple) those the step's tokens chose at most: n_tokens x k of E."""
    if node.op.value != "mul_mat_id" or not isinstance(v, (tuple, list)) or not v:
        return _nbytes(v)
    n, k = node.shape[0], node.shape[1]
    return sum(_nbytes(e) for e in v) * min(len(v), n * k) // len(v)


def kv_bytes_per_token(session, context: float, itemsize: int) -> float:
    """K and V of `context` earlier tokens, every layer."""
    return sum(2 * context * h * d * itemsize for h, d in session.model.kv_dims)


def hearthlm_bytes_per_token(session, context: float) -> float:
    """The prepared weights the one-token graph reads whole (each once; an embedding table that
    is only looked up reads one row), plus the K/V it reads."""
    from hearthlm.core.graph import Op
    from hearthlm.runtime.dispatch import STATIC
    graphs = session.engine.graphs._graphs
    sig = min(graphs, key=lambda s: s.shape.n_tokens)  # the decode graph, compiled at open
    steps = graphs[sig].compiled.steps
    static = {st.index: st.value for st in steps if st.kind is STATIC}
    seen: dict[int, int] = {}
    for st in steps:
        if st.node.op is not Op.GET_ROWS:
            for j in st.srcs:
                if j in static:
                    seen[id(static[j])] = read_bytes(st.node, static[j])
    return sum(seen.values()) + context * session.engine.kv.bytes_per_token  # its K/V type's bytes


def gguf_bytes_per_token(session, context: float) -> float:
    """llama.cpp reads the file's tensors as they are (of stacked experts, the expert_used_count chosen);
    a tied embedding is read whole as the output projection. K/V in float16, its default."""
    tensors = session.model.file.tensors
    lookup_only = "token_embd.weight" if "output.weight" in tensors else None
    c = session.model.config
    used = getattr(c, "n_expert_used", 0) / getattr(c, "n_expert", 0) if getattr(c, "n_expert", 0) else 1.0
    return (sum(t.nbytes * (used if len(t.shape) == 3 else 1.0) for t in tensors.values() if t.name != lookup_only)
            + kv_bytes_per_token(session, context, 2))
