"""`hearthlm graph --model M --tokens N [--no-fusion]`: the graph of one step of N tokens
(one sequence, one output row), before and after fusion, node by node (name, op, shape,
dtype, backend), and what the memory planner makes of it: ggml users' debugging view."""
from __future__ import annotations

import argparse

from hearthlm.backends import get_backend
from hearthlm.core.graph import Graph
from hearthlm.model_zoo.model import load_model
from hearthlm.model_zoo.resolve import resolve_model
from hearthlm.options import from_args
from hearthlm.runtime import fusion
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.memory import plan


def add_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1, help="tokens in the step (1: a decode step)")
    p.add_argument("--no-fusion", action="store_true", help="print the graph as built only")


def _dump(title: str, g: Graph, backend) -> str:
    p = plan(g, arena=backend.plans_memory)
    rows = [f"{'#':>5}  {'node':<26} {'op':<16} {'shape':<24} {'dtype':<8} backend"]
    for i, t in enumerate(g.nodes):
        where = backend.name if backend.supports(t) else "-"
        rows.append(f"{i:>5}  {t.label:<26} {t.op.value:<16} {str(t.shape):<24} {str(t.dtype):<8} {where}")
    head = (f"== {title}: {len(g.nodes)} nodes; intermediates {p.no_reuse_bytes / 1e6:.2f} MB unshared, "
            f"{p.arena_bytes / 1e6:.2f} MB planned ==")
    return "\n".join([head, *rows])


def run_graph(a: argparse.Namespace) -> None:
    o = from_args(a)
    model = load_model(resolve_model(a.model, filename=o.filename))
    try:
        backend = get_backend(o.backend)
        bs = 16
        n_ctx = min(o.n_ctx, model.config.n_ctx_train)
        width = -(-n_ctx // bs)
        shape = BatchShape(n_tokens=a.tokens, n_seqs=1, max_blocks=width, n_out=1, n_slots=(4 * width + 1) * bs,
                           block_size=bs)
        g = model.build_graph(shape)
        print(_dump(f"{model.arch_name} graph as built, {a.tokens} token(s)", g, backend))
        if not a.no_fusion:
            print()
            print(_dump("after fusion", fusion.fuse(g), backend))
    finally:
        model.close()
