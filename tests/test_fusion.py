"""Each fusion rule: (a) it matches what the architecture builders produce, (b) the graph
has fewer nodes after it, (c) the fused graph computes what the unfused one computes, on
`reference` and `cpu` (logits and the KV cache it wrote)."""
from collections import Counter

import numpy as np
import pytest
from synth import build, step_feed, weights
from test_backend_ops import nmse

from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.backends.reference import ReferenceBackend
from hearthlm.core.graph import Op
from hearthlm.runtime import fusion
from hearthlm.runtime.dispatch import run as run_graph

RULES = {r.name: r for r in fusion.RULES}
# rule -> (fused op, per layer in llama, per layer in gemma3, outside the layers); counted
# with the rule applied after the rules it builds on (NEEDS)
EXPECT = {
    "rms_norm_mul": (Op.RMS_NORM_MUL, 2, 6, 1),         # gemma3: attn, ffn, q, k and both post-norms
    "ffn_glu": (Op.FFN_GLU, 1, 1, 0),
    "rope_set_rows": (Op.ROPE_SET_ROWS, 1, 1, 0),
    "flash_attn": (Op.ATTN, 1, 1, 0),
    "mul_mat_add": (Op.MUL_MAT_ADD, 2, 0, 0),           # llama: attn_out and ffn_out into the residual
    "rms_norm_mul_add": (Op.RMS_NORM_MUL_ADD, 0, 2, 0),  # gemma3: both post-norms into the residual
}
NEEDS = {"rms_norm_mul_add": ["rms_norm_mul"]}
N_LAYER = {"llama": 2, "gemma3": 6}  # gemma3: five sliding-window layers and one global


def run(graph, backend, feed, caches):
    local = {k: v.copy() for k, v in caches.items()}
    (out,) = run_graph(graph, backend, feed, lambda n: local[(n.name, n.layer)])
    return out, local


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("rule", list(EXPECT))
def test_rule_matches_builders_and_shrinks(arch, rule):
    op, per_llama, per_gemma, extra = EXPECT[rule]
    per_layer = per_llama if arch == "llama" else per_gemma
    if not per_layer:
        pytest.skip(f"{arch} has no {rule} pattern")
    n_layer = N_LAYER[arch]
    _, shape, _ = step_feed(np.random.default_rng(0), n_layer)
    g = build(arch, weights(arch, n_layer, raw=False), shape, n_layer)
    before = fusion.fuse(g, [RULES[r] for r in NEEDS.get(rule, [])])
    after = fusion.fuse(g, [RULES[r] for r in NEEDS.get(rule, [])] + [RULES[rule]])
    assert Counter(n.op for n in after.nodes)[op] == per_layer * n_layer + extra
    assert len(after.nodes) < len(before.nodes)
    assert len(fusion.fuse(g).nodes) <= len(after.nodes)


def test_add_chains():
    """The builders never chain plain adds (each residual sum feeds a norm), so a chain is built here."""
    from hearthlm.core.graph import Graph
    g = Graph()
    xs = [g.input(f"x{i}", (3, 8), np.float32) for i in range(4)]
    s = g.add(g.add(g.add(xs[0], xs[1], "a"), xs[2], "b"), xs[3], "c")
    g.outputs.append(s)
    f = fusion.fuse(g)
    assert [n.op for n in f.nodes if n.op not in (Op.INPUT,)] == [Op.ADD_N] and len(f.nodes) < len(g.nodes)
    feed = {f"x{i}": np.random.default_rng(i).standard_normal((3, 8)).astype(np.float32) for i in range(4)}
    for be in (ReferenceBackend(), CPUBackend()):
        assert nmse(run(f, be, feed, {})[0], run(g, be, feed, {})[0]) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("rule", [*EXPECT, "all"])
def test_fused_computes_the_same(arch, rule, backend):
    """Fused (one rule, after those it builds on; or all) against unfused, same backend."""
    n_layer = N_LAYER[arch]
    feed, shape, caches = step_feed(np.random.default_rng(1), n_layer)
    ws = weights(arch, n_layer, seed=2)
    be = ReferenceBackend() if backend == "reference" else CPUBackend()
    base, base_kv = run(build(arch, ws, shape, n_layer), be, feed, caches)
    f = fusion.fuse(build(arch, ws, shape, n_layer), fusion.RULES if rule == "all" else
                    [RULES[r] for r in [*NEEDS.get(rule, []), rule]])
    out, kv = run(f, be, feed, caches)
    tol = 1e-12 if backend == "reference" else 1e-9  # attention: online vs two-pass softmax
    assert nmse(out, base) < tol
    for key in caches:
        assert nmse(kv[key], base_kv[key]) < tol, key


def test_no_fusion_switch(monkeypatch):
    monkeypatch.setenv("HEARTHLM_NO_FUSION", "1")
    assert not fusion.enabled() and fusion.enabled(True)
    monkeypatch.delenv("HEARTHLM_NO_FUSION")
    assert fusion.enabled() and not fusion.enabled(False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stacked_projections(arch):
    """q, k and v read the same normed x: one MUL_MAT over their stacked weights and a column
    SLICE each (with no other rule), computing what the three projections compute."""
    n_layer = N_LAYER[arch]
    feed, shape, caches = step_feed(np.random.default_rng(3), n_layer)
    ws = weights(arch, n_layer, seed=4)
    g = build(arch, ws, shape, n_layer)
    f = fusion.fuse(build(arch, ws, shape, n_layer), [])  # alone, gate and up stack too
    qkv = [n for n in f.nodes if n.op is Op.MUL_MAT and n.srcs[0].name.count("+") == 2]
    assert len(qkv) == n_layer and all("attn_q" in n.srcs[0].name for n in qkv)
    ops_g, ops_f = Counter(n.op for n in g.nodes), Counter(n.op for n in f.nodes)
    assert ops_f[Op.MUL_MAT] == ops_g[Op.MUL_MAT] - 3 * n_layer and ops_f[Op.SLICE] == 5 * n_layer
    # after the other rules, gate and up are inside the fused FFN: only q, k, v stack
    assert Counter(n.op for n in fusion.fuse(g).nodes)[Op.SLICE] == 3 * n_layer
    for be in (ReferenceBackend(), CPUBackend()):
        (out, kv), (base, base_kv) = run(f, be, feed, caches), run(g, be, feed, caches)
        assert nmse(out, base) < 1e-12
        assert all(nmse(kv[k], base_kv[k]) < 1e-12 for k in caches)


def test_stacking_groups_by_weight_type():
    """Qwen2.5's q and k are Q5_0 and its v Q8_0: q and k stack, v stays its own projection."""
    from gguf import GGMLQuantizationType as T

    from hearthlm.core.graph import Graph
    from hearthlm.core.weights import QWeight
    g = Graph()
    x = g.input("x", (3, 64), np.float32)
    for name, t in (("attn_q", T.Q5_0), ("attn_k", T.Q5_0), ("attn_v", T.Q8_0)):
        g.outputs.append(g.mul_mat(g.weight(QWeight(name, int(t), (32, 64), np.zeros((32, 0), np.uint8))), x, name))
    f = fusion.stack_matmuls(g)
    mms = [n for n in f.nodes if n.op is Op.MUL_MAT]
    assert sorted(n.srcs[0].name for n in mms) == ["attn_q+attn_k", "attn_v"]
    assert [n.op for n in f.outputs] == [Op.SLICE, Op.SLICE, Op.MUL_MAT]


@pytest.mark.parametrize("inv", [1 / 30.0, 1 / 29.0])
def test_softcapped_attention_fuses_only_as_a_cap(inv):
    """Gemma 2's scores, cap * tanh(s * (1/cap)), become one ATTN carrying the cap; a chain
    whose two scales are not inverse is some other function and stays unfused."""
    from hearthlm.core.graph import Graph
    g = Graph()
    q = g.input("q", (3, 4, 16), np.float32)
    seq, pos, bt = g.input("seq", (3,)), g.input("pos", (3,)), g.input("bt", (1, 2))
    kc, vc = g.cache("cache_k", (32, 2, 16), 0), g.cache("cache_v", (32, 2, 16), 0)
    s = g.scale(g.kq(q, g.gather_kv(kc, bt, block_size=16, name="k"), seq, "kq"), 0.25, "kq_scaled")
    s = g.scale(g.tanh(g.scale(s, inv, "capped_1"), "tanh"), 30.0, "capped")
    probs = g.soft_max(g.add(s, g.kq_mask(pos, n_kv=32, window=0, name="mask"), "masked"), "probs")
    out = g.kqv(probs, g.gather_kv(vc, bt, block_size=16, name="v"), seq, "kqv")
    g.outputs.append(g.reshape(out, (3, 64), "out"))
    attn = [n for n in fusion.fuse(g).nodes if n.op is Op.ATTN]
    if inv == 1 / 30.0:
        assert len(attn) == 1 and attn[0].params["softcap"] == 30.0 and attn[0].params["scale"] == 0.25
    else:
        assert not attn


@pytest.mark.parametrize("n_head", [4, 1])
def test_alibi_attention_fuses_with_its_bias(n_head):
    """An encoder's ALiBi mask (one row per head) becomes one ATTN carrying max_bias; a mask of
    one row over 4 query heads (not ALiBi's shape) stays unfused."""
    from hearthlm.core.graph import Graph
    g = Graph()
    q = g.input("q", (3, 4, 16), np.float32)
    seq, pos, bt, sl = g.input("seq", (3,)), g.input("pos", (3,)), g.input("bt", (1, 2)), g.input("sl", (3,))
    kc, vc = g.cache("cache_k", (32, 2, 16), 0), g.cache("cache_v", (32, 2, 16), 0)
    s = g.scale(g.kq(q, g.gather_kv(kc, bt, block_size=16, name="k"), seq, "kq"), 0.25, "kq_scaled")
    mask = g.kq_mask(pos, n_kv=32, seq_len=sl, alibi=8.0, n_head=n_head, name="mask")
    probs = g.soft_max(g.add(s, mask, "masked"), "probs")
    out = g.kqv(probs, g.gather_kv(vc, bt, block_size=16, name="v"), seq, "kqv")
    g.outputs.append(g.reshape(out, (3, 64), "out"))
    attn = [n for n in fusion.fuse(g).nodes if n.op is Op.ATTN]
    if n_head == 4:
        assert len(attn) == 1 and attn[0].params["alibi"] == 8.0 and not attn[0].params["causal"]
        assert attn[0].srcs[-1] is sl
    else:
        assert not attn
