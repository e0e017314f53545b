"""Fusion rules, kept as data: each Rule is a pattern (a small tree of ops, tinygrad's
UPat) and a rewrite that builds the one fused node replacing the matched subgraph. `fuse`
applies them once to a newly built graph, in node order, so a rule always sees its
sources already rewritten. HEARTHLM_NO_FUSION=1 turns fusion off (debugging)."""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Callable

from hearthlm.core.graph import Graph, Op, Tensor, lora_split
from hearthlm.core.weights import stacked_weight


@dataclass(frozen=True)
class Pat:
    """A node of op `op` (one of, if a tuple) with sources matching `srcs`; `srcs=None`
    checks no sources. op None captures any node under `name` (same name: same node).
    Matched inner nodes must have one consumer: the rewrite absorbs them."""
    op: Op | tuple[Op, ...] | None
    srcs: tuple["Pat", ...] | None = ()
    name: str | None = None


def P(op, *srcs, name=None, any_srcs=False) -> Pat:
    return Pat(op, None if any_srcs else tuple(srcs), name)


class _X:  # X.w is a capture named "w"
    def __getattr__(self, name: str) -> Pat:
        return Pat(None, (), name)


X = _X()


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    rewrite: Callable[[Graph, Tensor, dict], Tensor | None]  # (graph, root, captures) -> fused node or None


def _norm_add(g, root, m):
    return g.rms_norm_mul_add(m["x"], m["w"], m["r"], m["norm"].params["eps"], root.name, root.layer)


def _attn_pattern(softcap: bool, sinks: bool = False) -> P:
    scores = P(Op.SCALE, P(Op.KQ, X.q, P(Op.GATHER_KV, X.kc, X.bt, name="gk"), X.seq), name="scale")
    if softcap:  # softcap * tanh(scores / softcap)
        scores = P(Op.SCALE, P(Op.TANH, P(Op.SCALE, scores, name="inv")), name="cap")
    masked = P(Op.ADD, scores, P(Op.KQ_MASK, name="mask", any_srcs=True))
    probs = P(Op.SOFT_MAX, masked, X.sinks) if sinks else P(Op.SOFT_MAX, masked)
    return P(Op.RESHAPE, P(Op.KQV, probs, P(Op.GATHER_KV, X.vc, X.bt), X.seq))


def _attn(g, root, m, softcap: float):
    mask = m["mask"]  # (pos) causal, or (pos, seq_len) an encoder's; ALiBi's slopes per query head
    alibi = mask.params.get("alibi", 0.0)
    if alibi > 0 and mask.shape[1] != m["q"].shape[1]:
        return None
    return g.attn(m["q"], m["kc"], m["vc"], m["seq"], mask.srcs[0], m["bt"], scale=m["scale"].params["s"],
                  block_size=m["gk"].params["block_size"], window=mask.params["window"], softcap=softcap,
                  alibi=alibi, seq_len=mask.srcs[1] if len(mask.srcs) > 1 else None, sinks=m.get("sinks"),
                  causal=mask.params["causal"],
                  name=root.name, il=root.layer)


def _mul_mat_lora(g, root, m):
    """A projection and its adapters' products: one node (MUL_MAT_LORA), one call and one walk step."""
    mm = root.srcs[0]  # (a pattern cannot name a node's first source alone): the hook's LORA takes its product
    if mm.op is not Op.MUL_MAT or mm.srcs[0].op is not Op.WEIGHT or root.srcs[1] is not mm.srcs[1]:
        return None
    pairs = list(zip(root.srcs[3::2], root.srcs[4::2]))
    return g.proj_lora(Op.MUL_MAT_LORA, mm.srcs, root.srcs[2], [(pairs, root.params["cols"], root.params["alphas"])],
                       root.name, root.layer)


def _parts(node) -> list:
    """A fused LoRA node's parts as Graph.proj_lora takes them: [(pairs, cols, alphas)]."""
    return [(list(zip(ab[::2], ab[1::2])), cols, alphas) for cols, alphas, ab in lora_split(node, node.srcs)[2]]


def _lora_add(g, root, m):
    """A LoRA'd projection into the residual: (w x + the adapters' products) + r, as llama.cpp."""
    lo, r = m["lo"], m["r"]
    if not r.shape == root.shape == lo.shape:
        return None
    return g.proj_lora(Op.MUL_MAT_ADD_LORA, (*lo.srcs[:2], r), lo.srcs[2], _parts(lo), root.name, root.layer)


def _ffn_glu_lora(g, root, m):
    """act(gate x) * up x with either's adapters: one FFN_GLU_LORA node (as ffn_glu, no gate or up whole
    between nodes)."""
    gate, up = m["g"], m["u"]
    if Op.MUL_MAT_LORA not in (gate.op, up.op) or gate.shape != up.shape or gate.srcs[1] is not up.srcs[1] \
            or gate.srcs[0].op is not Op.WEIGHT or up.srcs[0].op is not Op.WEIGHT:
        return None
    scales = {t.srcs[2] for t in (gate, up) if t.op is Op.MUL_MAT_LORA}
    if len(scales) != 1:
        return None
    parts = [p for t in (gate, up) for p in (_parts(t) if t.op is Op.MUL_MAT_LORA else [([], (), ())])]
    return g.proj_lora(Op.FFN_GLU_LORA, (gate.srcs[0], up.srcs[0], gate.srcs[1]), scales.pop(), parts, "ffn_glu",
                       root.layer, act="gelu" if m["act"].op is Op.GELU else "silu")


RULES = [
    # RMSNorm then its weight: one pass over each row
    Rule("rms_norm_mul", P(Op.MUL, P(Op.RMS_NORM, X.x, name="norm"), X.w),
         lambda g, root, m: g.rms_norm_mul(m["x"], m["w"], m["norm"].params["eps"], root.name, root.layer)
         if m["w"].shape == (m["x"].shape[-1],) else None),
    # act(gate x) * up x from the weights and x: SwiGLU / GeGLU with no whole gate or up
    Rule("ffn_glu", P(Op.MUL, P((Op.SILU, Op.GELU), P(Op.MUL_MAT, X.wg, X.x), name="act"),
                      P(Op.MUL_MAT, X.wu, X.x)),
         lambda g, root, m: g.ffn_glu(m["wg"], m["wu"], m["x"], "gelu" if m["act"].op is Op.GELU else "silu",
                                      "ffn_glu", root.layer)
         if m["wg"].op is Op.WEIGHT and m["wu"].op is Op.WEIGHT and m["wg"].shape == m["wu"].shape else None),
    # RoPE on K written straight into the KV cache
    Rule("rope_set_rows", P(Op.SET_ROWS, X.cache, P(Op.ROPE, X.x, X.pos, name="rope"), X.slots),
         lambda g, root, m: g.rope_set_rows(m["cache"], m["x"], m["pos"], m["slots"], name=root.name,
                                            il=root.layer, **m["rope"].params)),
    # gather, QK^T, scale (and Gemma 2's soft-capping), mask, softmax, times V: flash attention
    # over the paged cache
    Rule("flash_attn", _attn_pattern(False), lambda g, root, m: _attn(g, root, m, 0.0)),
    Rule("flash_attn_sinks", _attn_pattern(False, sinks=True), lambda g, root, m: _attn(g, root, m, 0.0)),
    Rule("flash_attn_softcap", _attn_pattern(True),
         lambda g, root, m: _attn(g, root, m, m["cap"].params["s"])
         if abs(m["cap"].params["s"] * m["inv"].params["s"] - 1.0) < 1e-6 else None),
    # residual adds: into the projection or post-norm that produces the addend
    Rule("mul_mat_add", P(Op.ADD, X.r, P(Op.MUL_MAT, X.w, X.x, name="mm")),
         lambda g, root, m: g.mul_mat_add(m["w"], m["x"], m["r"], root.name, root.layer)
         if m["r"].shape == root.shape == m["mm"].shape else None),
    # LoRA adapters (chosen per request) in their projection's node
    Rule("mul_mat_lora", P(Op.LORA, any_srcs=True), _mul_mat_lora),
    Rule("mul_mat_add_lora", P(Op.ADD, X.r, P(Op.MUL_MAT_LORA, name="lo", any_srcs=True)), _lora_add),
    Rule("ffn_glu_lora", P(Op.MUL, P((Op.SILU, Op.GELU), P((Op.MUL_MAT, Op.MUL_MAT_LORA), name="g", any_srcs=True),
                                     name="act"), P((Op.MUL_MAT, Op.MUL_MAT_LORA), name="u", any_srcs=True)),
         _ffn_glu_lora),
    Rule("rms_norm_mul_add", P(Op.ADD, X.r, P(Op.RMS_NORM_MUL, X.x, X.w, name="norm")),
         lambda g, root, m: _norm_add(g, root, m) if m["r"].shape == root.shape == m["norm"].shape else None),
    # and chains of plain adds: one n-ary sum
    Rule("add_n", P(Op.ADD, P((Op.ADD, Op.ADD_N), name="inner", any_srcs=True), X.c),
         lambda g, root, m: g.add_n((*m["inner"].srcs, m["c"]), root.name, root.layer)
         if all(s.shape == root.shape for s in (*m["inner"].srcs, m["c"])) else None),
]


def enabled(option: bool | None = None) -> bool:
    """A Session/Engine option wins; else HEARTHLM_NO_FUSION=1 turns fusion off."""
    return option if option is not None else os.environ.get("HEARTHLM_NO_FUSION", "") not in ("1", "true", "yes")


def _match(p: Pat, node: Tensor, uses: dict, m: dict, root: bool) -> bool:
    if p.op is None:
        if p.name in m:
            return m[p.name] is node
        m[p.name] = node
        return True
    if node.op not in (p.op if isinstance(p.op, tuple) else (p.op,)) or (not root and uses.get(node, 0) != 1):
        return False
    if p.name:
        m[p.name] = node
    if p.srcs is None:
        return True
    if len(p.srcs) != len(node.srcs):
        return False
    orders = [p.srcs, p.srcs[::-1]] if node.op.props.commutative and len(p.srcs) == 2 else [p.srcs]
    for srcs in orders:
        trial = dict(m)
        if all(_match(sp, s, uses, trial, False) for sp, s in zip(srcs, node.srcs)):
            m.update(trial)
            return True
    return False


def match(rule: Rule, node: Tensor, uses: dict) -> dict | None:
    m: dict = {}
    return m if _match(rule.pattern, node, uses, m, True) else None


def consumers(graph: Graph) -> dict[Tensor, int]:
    uses: dict[Tensor, int] = {}
    for n in graph.nodes:
        for s in n.srcs:
            uses[s] = uses.get(s, 0) + 1
    for o in graph.outputs:
        uses[o] = uses.get(o, 0) + 1
    return uses


def fuse(graph: Graph, rules: list[Rule] = RULES) -> Graph:
    """A new graph with the rules applied (the input graph is left as it was)."""
    uses = consumers(graph)
    by_op: dict[Op, list[Rule]] = {}
    for r in rules:
        for op in (r.pattern.op if isinstance(r.pattern.op, tuple) else (r.pattern.op,)):
            by_op.setdefault(op, []).append(r)
    out = Graph()
    out.inputs = dict(graph.inputs)
    new: dict[Tensor, Tensor] = {}
    for node in graph.nodes:
        srcs = tuple(new.get(s, s) for s in node.srcs)
        n = node if srcs == node.srcs else dataclasses.replace(node, srcs=srcs)
        uses[n] = uses.get(node, 0)
        for rule in by_op.get(n.op, ()):
            m = match(rule, n, uses)
            f = rule.rewrite(out, n, m) if m is not None else None
            if f is not None:
                uses[f], n = uses[n], f
                break
        else:
            out.nodes.append(n)
        if n is not node:
            new[node] = n
    out.outputs = [new.get(o, o) for o in graph.outputs]
    return prune(stack_matmuls(out))


def stack_matmuls(graph: Graph) -> Graph:
    """Projections of the same activations (q, k and v) as one MUL_MAT over their stacked
    weights and a column SLICE each: one kernel launch and one quantization of x, not three.
    LoRA'd ones (MUL_MAT_LORA, the same scales) likewise, their adapters on their columns."""
    groups: dict[tuple, list[Tensor]] = {}
    for n in graph.nodes:
        if n.op is Op.MUL_MAT and n.srcs[0].op is Op.WEIGHT:
            groups.setdefault((id(n.srcs[1]),), []).append(n)
        elif n.op is Op.MUL_MAT_LORA and n.srcs[0].op is Op.WEIGHT and "out_cols" not in n.params:
            groups.setdefault((id(n.srcs[1]), id(n.srcs[2])), []).append(n)  # and the same scales
    first: dict[int, list[Tensor]] = {}
    for mms in groups.values():
        by_type: dict[tuple, list[Tensor]] = {}  # stackable: same type and width (Qwen's q and k, not its Q8_0 v)
        for m in mms:
            w = m.srcs[0].params["weight"]
            by_type.setdefault((w.ggml_type, w.shape[1], len(w.shape)), []).append(m)
        for same in by_type.values():
            if len(same) > 1:
                first[id(same[0])] = same
    if not first:
        return graph
    out = Graph()
    out.inputs = dict(graph.inputs)
    new: dict[Tensor, Tensor] = {}
    hoisted: set[int] = set()  # later members' adapter weights, placed before the stacked node (leaves)
    for node in graph.nodes:
        if id(node) in hoisted:
            continue
        if id(node) in first:
            mms = first[id(node)]
            w = out.weight(stacked_weight([m.srcs[0].params["weight"] for m in mms]))
            x = new.get(mms[0].srcs[1], mms[0].srcs[1])
            name = "+".join(m.name for m in mms)
            if node.op is Op.MUL_MAT_LORA:  # each weight's adapters on its columns
                parts, ends = [], list(itertools.accumulate([0] + [m.shape[-1] for m in mms]))
                for m in mms:
                    (part,) = _parts(m)
                    parts.append(part)
                    if m is not node:
                        ab = [t for pair in part[0] for t in pair]
                        out.nodes += [t for t in ab if id(t) not in hoisted]
                        hoisted.update(map(id, ab))
                y = out.proj_lora(Op.MUL_MAT_LORA, (w, x), new.get(node.srcs[2], node.srcs[2]), parts, name, node.layer,
                                  out_cols=tuple((int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])))
            else:
                y = out.mul_mat(w, x, name, node.layer)
            r0 = 0
            for m in mms:
                new[m] = out.slice(y, r0, r0 + m.shape[-1], m.name, m.layer)
                r0 += m.shape[-1]
            continue
        if node in new:  # a later member of a stacked group: its slice stands in
            continue
        srcs = tuple(new.get(s, s) for s in node.srcs)
        n = node if srcs == node.srcs else dataclasses.replace(node, srcs=srcs)
        out.nodes.append(n)
        if n is not node:
            new[node] = n
    out.outputs = [new.get(o, o) for o in graph.outputs]
    return out


def prune(graph: Graph) -> Graph:
    """Drop nodes nothing needs: what the rewrites absorbed."""
    keep: set[int] = set()
    # kept though unread: cache writes (and state updates)
    stack = [*graph.outputs, *(n for n in graph.nodes if n.op.props.writes_cache or n.op.props.updates_state)]
    while stack:
        n = stack.pop()
        if id(n) not in keep:
            keep.add(id(n))
            stack.extend(n.srcs)
    graph.nodes = [n for n in graph.nodes if id(n) in keep]
    return graph
