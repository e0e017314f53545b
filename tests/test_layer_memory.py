"""Each architecture's layer memory (core.layer_memory), declared once in its config and read by
the KV cache, the recurrent state and the attention builder: checked against the files' own
metadata and against the graphs the builders make, on the converter-made test models."""
from __future__ import annotations

from pathlib import Path

import pytest

from hearthlm.core.graph import Op
from hearthlm.core.layer_memory import LayerMemory
from hearthlm.model_zoo.model import load_model
from hearthlm.runtime.batch import one_token

DIR = Path(__file__).parent / "data" / "converted"
DECODERS = [p.stem for p in sorted(DIR.glob("*.gguf"))
            if not any(k in p.stem for k in ("bert", "embedding", ".mmproj"))]


def _nodes(model, op, name=None):
    g = model.build_graph(one_token(n_state=2 if any(m.state for m in model.layer_memory) else 0))
    return [n for n in g.nodes if n.op is op and (name is None or n.name == name)]


@pytest.mark.parametrize("name", DECODERS)
def test_the_graph_reads_the_declared_memory(name):
    """Every attention mask's window is its layer's declared window, every layer that declares
    K/V of its own has a K cache in the graph, and no other layer does. Catches a builder that
    keeps a window of its own (Gemma 4's build passing window=c.sliding_window on every layer),
    and a declaration that disagrees with the graph's caches."""
    m = load_model(DIR / f"{name}.gguf")
    mem = m.layer_memory
    assert len(mem) == m.config.n_layer
    masks = {n.layer: n.params["window"] for n in _nodes(m, Op.KQ_MASK)}
    for il, w in masks.items():
        assert w == mem[il].window, (il, w, mem[il])
    k_layers = {n.layer for n in _nodes(m, Op.CACHE, "cache_k")}
    assert k_layers == {il for il, x in enumerate(mem) if x.kind in ("full", "sliding")}
    for il, x in enumerate(mem):
        if x.kind in ("full", "sliding"):
            assert x.kv_dims == (m.config.n_head_kv_of(il), m.config.head_dim_of(il))
        else:
            assert x.kv_dims == (0, 0)


def test_gemma4_declares_sliding_full_and_shared_layers():
    """Gemma 4's kinds come from its metadata: the sliding pattern, the per-layer K/V heads, and
    shared_kv_layers at the end reading the last earlier layer of their kind. Catches kv_source
    ignored by the declaration (layer_memory's shared branch removed: those layers would get
    caches of their own)."""
    m = load_model(DIR / "gemma4-kv-heads.gguf")
    md, c = m.metadata, m.config
    pattern = list(md["gemma4.attention.sliding_window_pattern"])
    heads = list(md["gemma4.attention.head_count_kv"])
    n_shared = int(md.get("gemma4.attention.shared_kv_layers", 0))
    for il, x in enumerate(m.layer_memory):
        if il >= c.n_layer - n_shared:
            assert x.kind == "shared" and pattern[x.kv_from] == pattern[il] and x.kv_from < c.n_layer - n_shared
        else:
            assert x.kind == ("sliding" if pattern[il] else "full")
            assert x.n_head_kv == heads[il]
            assert x.window == (md["gemma4.attention.sliding_window"] if pattern[il] else 0)


@pytest.mark.parametrize("name", ["lfm2", "lfm2moe", "granitehybrid", "granitehybrid-moe"])
def test_hybrids_declare_recurrent_layers_where_the_file_has_no_kv_heads(name):
    """A hybrid's recurrent layers are where its file's head_count_kv is 0, each with the state
    its mixer reads (the graph's state caches by layer). Catches a declaration that drops the
    recurrent layers' state (layer_memory appending LayerMemory() for them)."""
    path = DIR / f"{name}.gguf"
    m = load_model(path)
    heads = m.metadata[f"{m.arch_name}.attention.head_count_kv"]
    kinds = ["recurrent" if x.kind == "recurrent" else "attention" for x in m.layer_memory]
    assert kinds == ["recurrent" if h == 0 else "attention" for h in heads]
    states = {(n.layer, n.name) for n in _nodes(m, Op.CACHE) if n.name.startswith("state_")}
    assert states == {(il, k) for il, x in enumerate(m.layer_memory) for k in x.state}


def test_kinds():
    """The kind names the runtime and docs use (core.layer_memory)."""
    assert [LayerMemory(2, 8).kind, LayerMemory(2, 8, window=4).kind, LayerMemory(kv_from=1).kind,
            LayerMemory(state={"s": (1,)}).kind, LayerMemory().kind] == ["full", "sliding", "shared", "recurrent", "none"]
    assert LayerMemory(kv_from=1, n_head_kv=2, head_dim=8).kv_dims == (0, 0)
