"""Gemma 4 26B-A4B's layout beyond the parity runs (test_arch_parity, test_converted): the experts'
gate and up as two tensors (llama.cpp reads them when ffn_gate_up_exps is absent) give the fused
file's outputs, and a file missing what the experts need is refused naming it."""
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from hearthlm import Session
from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import Graph
from hearthlm.core.weights import QWeight

sys.path.insert(0, str(Path(__file__).parent / "parity"))
sys.path.insert(0, str(Path(__file__).parent))
from models import VARIANTS, write  # noqa: E402
from test_cuda_launch import fake_ops  # noqa: E402,F401 (the fixture)


def _split_gate_up(src: Path, dst: Path) -> Path:
    """A copy whose ffn_gate_up_exps (E, 2f, e) are written as ffn_gate_exps and ffn_up_exps (gate first)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "gemma4")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data, np.float32)
        if t.name.endswith("ffn_gate_up_exps.weight"):
            half = data.shape[1] // 2
            w.add_tensor(t.name.replace("gate_up", "gate"), np.ascontiguousarray(data[:, :half]))
            w.add_tensor(t.name.replace("gate_up", "up"), np.ascontiguousarray(data[:, half:]))
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


async def _steps(path: Path, prompt: list[int]):
    async with Session.open(str(path), backend="reference", n_ctx=64, kv_cache_type="f32") as s:
        c = await s.generate(prompt, max_tokens=4, temperature=0, top_logprobs=5)
    return c.token_ids, c.top_logprobs


async def test_separate_gate_and_up_experts_match_the_fused_ones(tmp_path):
    """Mutation: taking the fused tensor's halves the other way round (up first) fails it."""
    fused = write(tmp_path / "fused.gguf", "gemma4-moe")
    apart = _split_gate_up(fused, tmp_path / "apart.gguf")
    assert "blk.0.ffn_gate_exps.weight" in {t.name for t in gguf.GGUFReader(str(apart)).tensors}
    ids_a, lp_a = await _steps(fused, [5, 70, 33, 101, 9])
    ids_b, lp_b = await _steps(apart, [5, 70, 33, 101, 9])
    assert ids_a == ids_b
    for a, b in zip(lp_a, lp_b):
        assert dict(a).keys() == dict(b).keys()
        assert max(abs(dict(a)[t] - dict(b)[t]) for t in dict(a)) < 1e-4


@pytest.mark.parametrize("defects, needle", [
    ({"drop": "blk.1.ffn_down_exps.weight"}, "blk.1.ffn_down_exps.weight"),
    ({"drop": "blk.0.ffn_gate_up_exps.weight"}, "blk.0.ffn_gate_up_exps.weight"),
    ({"drop": "blk.2.ffn_gate_inp.scale"}, "blk.2.ffn_gate_inp.scale"),
    ({"drop": "blk.3.pre_ffw_norm_2.weight"}, "blk.3.pre_ffw_norm_2.weight"),
    ({"shape": {"blk.0.ffn_down_exps.weight": (4, 64, 16)}}, "blk.0.ffn_down_exps.weight"),
    ({"metadata": {"expert_used_count": 9}}, "expert_used_count"),
])
def test_a_bad_moe_file_names_the_problem(tmp_path, defects, needle):
    """Mutation: reading ffn_gate_up_exps as optional whatever the file holds fails the second case (the
    error then names ffn_gate_exps, which the file never had)."""
    from hearthlm.model_zoo.model import load_model
    p = write(tmp_path / "bad.gguf", "gemma4-moe", defects=defects)
    with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
        load_model(p)


def test_experts_need_their_width(tmp_path):
    """Mutation: defaulting expert_feed_forward_length to feed_forward_length fails it."""
    from hearthlm.model_zoo.model import load_model
    arch, md, tensors = VARIANTS["gemma4-moe"]
    with pytest.raises(ModelLoadError, match=r"expert_feed_forward_length"):
        load_model(write(tmp_path / "bad.gguf", (arch, {**md, "expert_feed_forward_length": None}, tensors)))


def test_the_cuda_backend_has_every_op_of_the_moe_graph(tmp_path, fake_ops):
    """No GPU here: the cuda ops module over numpy standing in for cupy (test_cuda_launch's fixture). Every op
    of gemma4-moe's fused graph (prefill and decode shapes) has a cuda kernel, and the two the experts add where
    other MoE files have none run as they should there: the fused gate/up product's halves (SLICE of a 3-d
    array) and each chosen expert's down scale (GET_ROWS of the (E, 1) float vector).
    Mutation: cuda's slice_ taking x[:, start:stop] (the wrong axis) fails it."""
    from hearthlm.core.graph import Op
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime import fusion
    from hearthlm.runtime.batch import BatchShape
    ops, _fake, _launches = fake_ops
    m = load_model(write(tmp_path / "m.gguf", "gemma4-moe"))
    try:
        used = set()
        for n in (1, 8):
            g = fusion.fuse(m.build_graph(BatchShape(n_tokens=n, n_seqs=1, max_blocks=4, n_out=1, n_slots=64,
                                                     block_size=16, n_state=0)))
            used |= {node.op for node in g.nodes}
    finally:
        m.close()
    assert {Op.MUL_MAT_ID, Op.SLICE, Op.GET_ROWS} <= used
    assert used - {Op.INPUT, Op.WEIGHT, Op.CACHE, Op.COPY} <= set(ops.KERNELS), "ops without a cuda kernel"
    gu = np.arange(3 * 2 * 8, dtype=np.float32).reshape(3, 2, 8)  # (n_tokens, k, 2 * n_ff)
    g = Graph()
    x = g.input("gu", gu.shape, dtype=np.float32)
    for lo, hi in ((0, 4), (4, 8)):
        np.testing.assert_array_equal(ops.KERNELS[Op.SLICE](g.slice(x, lo, hi, "half"), gu), gu[..., lo:hi])
    s = np.array([[0.5], [2.0], [3.0], [4.0]], np.float32)  # (E, 1)
    ids = np.array([3, 0, 0, 2], np.int32)
    rows = g.get_rows(g.input("s", s.shape, dtype=np.float32), g.input("ids", ids.shape), "down_s")
    np.testing.assert_array_equal(ops.KERNELS[Op.GET_ROWS](rows, s, ids), s[ids])


def test_bench_counts_the_chosen_experts_bytes():
    """The roofline and profile count of stacked experts (a backend's tuple of prepared weights) what a step's
    tokens can choose, n_tokens x k of E, not nothing (a tuple has no nbytes) nor all of them.
    Mutation: read_bytes returning _nbytes(v) for experts fails it (0 counted)."""
    from hearthlm.bench.roofline import read_bytes
    g = Graph()
    experts = g.weight(QWeight("e", 0, (8, 4, 32), np.zeros((32, 128), np.uint8)))
    one = np.zeros((4, 32), np.float32)  # 512 bytes an expert
    for n, want in ((1, 2 * 512), (3, 6 * 512), (16, 8 * 512)):
        node = g.mul_mat_id(experts, g.input(f"x{n}", (n, 32), dtype=np.float32), g.input(f"ids{n}", (n, 2)), "up")
        assert read_bytes(node, tuple(one for _ in range(8))) == want
    assert read_bytes(g.mul_mat(g.weight(QWeight("w", 0, (4, 32), np.zeros((4, 128), np.uint8))),
                                g.input("x", (1, 32), dtype=np.float32), "mm"), one) == 512
