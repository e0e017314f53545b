"""Every architecture (and RoPE scaling kind) on a tiny random F32 model against llama.cpp's
outputs recorded once by tests/parity/record.py: greedy steps with top-5 as the golden
README, the first step's top-1 log-prob within 0.05 nats; and, F32 on both sides, every
log-prob of a token in both top-5 lists within 0.05 nats while the sequences agree."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm import Session

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402
from models import VARIANTS, write  # noqa: E402

RECORDED = json.loads((Path(__file__).parent / "data" / "arch_parity.json").read_text())


def test_every_architecture_is_recorded():
    archs = {VARIANTS[v][0] for v in RECORDED}
    assert archs == {a for a, _, _ in VARIANTS.values()}, "record it: tests/parity/record.py"


# llama.cpp's reference run for Gemma 4 keeps K/V in float32 (models.LLAMA_KW): so does ours there (an
# f16 cache moves its lower-ranked log-probs by up to 0.08 nat, llama.cpp's own f16 cache alike)
KV_TYPE = {"gemma4": "f32", "gemma4-moe": "f32"}
TOLERANCE: dict[tuple[str, str], float] = {}


def _logprobs(case, c, tol: float = 0.05) -> str | None:
    for step, (ours, want, a, b) in enumerate(zip(c.top_logprobs, case["steps"], c.token_ids, case["greedy_ids"])):
        mine = dict(ours)
        for t, lp in zip(want["top_ids"], want["top_logprobs"]):
            if t in mine and abs(mine[t] - lp) > tol:
                return f"step {step}: token {t} log-prob {mine[t]:.4f} vs llama.cpp {lp:.4f}"
        if a != b:
            return None
    return None


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("variant", sorted(RECORDED))
async def test_matches_llama_cpp(tmp_path, monkeypatch, variant, backend):
    """Mutations: qwen3moe.moe_ffn not renormalizing the chosen experts' weights (norm_w=False) fails qwen3vlmoe
    (and qwen3moe); gemma4 without its per-expert down scales (down_s=None) fails gemma4-moe."""
    monkeypatch.setattr(golden, "TOP1_LOGPROB_TOL", 0.05)  # F32 weights on both sides
    path = write(tmp_path / f"{variant}.gguf", variant)
    failures = []
    async with Session.open(str(path), backend=backend, n_ctx=256, kv_cache_type=KV_TYPE.get(variant, "f16")) as s:
        for i, case in enumerate(RECORDED[variant]):
            c = await s.generate(case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0,
                                 top_logprobs=5)
            why = (golden.compare(case, c.token_ids, c.top_logprobs, c.finish_reason)
                   or _logprobs(case, c, TOLERANCE.get((variant, backend), 0.05)))
            if why:
                failures.append(f"prompt {i}: {why}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fusion_rules_fire(tmp_path, variant):
    """The fused graph of every architecture: flash attention (but under Gemma 2's logit
    soft-capping), K's RoPE into the cache, and the gated FFN as one op (Phi-3's halves of
    ffn_up included)."""
    from hearthlm.core.graph import Op
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime import fusion
    from hearthlm.runtime.batch import BatchShape

    m = load_model(write(tmp_path / "m.gguf", variant))
    try:
        g = fusion.fuse(m.build_graph(BatchShape(n_tokens=8, n_seqs=1, max_blocks=4, n_out=1, n_slots=64,
                                                 block_size=16, n_state=3)))
        ops = [n.op for n in g.nodes]
        n = m.config.n_layer
        n_attn = sum(m.config.has_attention(il) for il in range(n))  # hybrids: the attention layers
        kv = m.kv_dims  # (0, 0): no K written (a recurrent layer, or Gemma 4's shared K/V)
        roped = sum(kv[il] != (0, 0) and m.config.uses_rope(il) for il in range(n))  # NoPE layers
        assert ops.count(Op.ROPE_SET_ROWS) == roped
        assert ops.count(Op.ATTN) == n_attn and Op.KQ not in ops  # Gemma 2: soft-capped scores too
        recurrent = n - n_attn
        assert ops.count(Op.SSM_CONV) == recurrent  # every recurrent layer starts with its conv
        if not getattr(m.config, "n_expert", 0):
            assert ops.count(Op.FFN_GLU) == n and Op.GLU not in ops
    finally:
        m.close()


async def test_an_alias_reads_its_own_keys(tmp_path, monkeypatch):
    """A second name for the llama module (one registry line): its file's keys are under its
    own prefix, and it computes what llama computes."""
    from hearthlm.model_zoo import models as registry
    monkeypatch.setitem(registry.ARCHITECTURES, "llama-alias", "llama")
    monkeypatch.setitem(VARIANTS, "llama-alias", ("llama-alias", {}, {}))
    path = write(tmp_path / "alias.gguf", "llama-alias")
    case = RECORDED["llama"][0]
    async with Session.open(str(path), backend="cpu", n_ctx=256) as s:
        assert s.model.arch_name == "llama-alias" and "llama-alias.block_count" in s.model.metadata
        c = await s.generate(case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0)
    assert c.token_ids == case["greedy_ids"]


async def test_gpt_oss_with_mxfp4_experts(tmp_path):
    """gpt-oss as ggml-org ships it, its experts MXFP4 (random blocks): the cpu's lookup kernels in the
    expert matmuls give the numpy reference's greedy tokens (gguf.quants dequantizes there)."""
    from gguf.constants import GGMLQuantizationType as T
    path = str(write(tmp_path / "m.gguf", "gpt-oss", qtypes=lambda name, shape: T.MXFP4 if "_exps.weight" in name else None))
    prompt = [1] + [3 + (i * 7) % 31 for i in range(20)]
    out = {}
    for backend in ("cpu", "reference"):
        async with Session.open(path, backend=backend, n_ctx=256) as s:
            c = await s.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=1)
            out[backend] = (c.token_ids, [t[0][1] for t in c.top_logprobs])
    assert out["cpu"][0] == out["reference"][0]
    # the cpu multiplies int8-quantized activations, as llama.cpp does: off the exact sums by 0.001 nat at
    # the first step, by up to 0.1 once those errors are in the context (the same test's criterion as above)
    diff = np.abs(np.subtract(out["cpu"][1], out["reference"][1]))
    assert diff[0] < 0.01 and diff.max() < 0.15, diff
