"""The three real models with a quantized KV cache against llama.cpp run with the same cache
type (-ctk/-ctv q8_0 and q4_0, its Hadamard rotation of K/V off; recorded once by
tests/parity/record_kv_quant.py into tests/data/kv_quant.json): greedy steps by the golden
criterion (tests/golden.py), and perplexity on tests/data/ppl_text.txt by llama-perplexity's method.
Then every KV type (core.kv_types: f16, q8_0, q4_0, q5_0, q5_1, iq4_nl, the quantized ones with and
without "+rot", llama.cpp's Hadamard rotation) beside llama.cpp's perplexity with the same type_k /
type_v and rotation (tests/parity/record_kv_types.py -> tests/data/kv_types_ppl.json): one case in
the suite, the table on the three models `make test-kv-types` (pytest -m long)."""

import pytest
from conftest import DATA, _model, load_json
from golden import check_golden

from hearthlm import Session
from hearthlm.core import kv_types
from hearthlm.perplexity import chunk_nlls, summary

REF = load_json("kv_quant.json")["models"]
F16 = load_json("perplexity.json")["models"]
TEXT = (DATA / "ppl_text.txt").read_text(encoding="utf-8")
FIXTURE = {"smollm2-135m-instruct": "smollm2_path", "gemma-3-270m": "gemma3_path",
           "qwen2.5-coder-0.5b-instruct": "qwen2_path"}
# Qwen2.5 under q4_0 is left out: its keys' outlier channels make it a ruin in llama.cpp and ours alike
# (perplexity 23.9 and 27.9 against 3.08), and its greedy path then turns on the rounding of single
# blocks: on an AVX-512 host it leaves llama.cpp's top 5 at step 5 where the AVX2 one did not
CASES = [(m, t) for m in REF for t in ("q8_0", "q4_0") if (m, t) != ("qwen2.5-coder-0.5b-instruct", "q4_0")]


# first-step top-1 log-prob tolerance: a quantized cache moves these log-probs, llama.cpp's own by
# up to 1.26 nats (q8_0, Qwen2.5's second case) and 2.34 (q4_0) from its f16 cache's, and its
# kernel also rounds Q to 8 bits for the products with quantized K (ours keeps Q in float32)
TOP1_TOL = {"q8_0": 0.5, "q4_0": 1.0}  # q4_0: Gemma 3's case 5 is 0.924 nat off (a near-tie of 0.08 nat
# between its two top tokens), llama.cpp's own q4_0 moves 2.34. Once 0.92 in a fresh clone's full run and
# 0.75 alone: the full run compiled the kernels in its process, the run alone loaded them from numba's cache,
# and the two copies of the GLU differed in their last bits (reassociation; fixed by ops._JIT_ORDERED). Now
# the same bits compiled or cached, alone or after other tests (tests/test_kernel_cache.py; threads, chunks
# and neighbours: tests/test_invariance_real.py)
# Qwen2.5's q8_0 case 1: ours -1.22 (AVX-512 host) for llama.cpp's -1.85, whose own q8_0 run moved it by 1.26
TOP1_TOL_MODEL = {("qwen2.5-coder-0.5b-instruct", "q8_0"): 0.75}
# q4_0's greedy path turns on the rounding of 4-bit K/V codes: a perturbation as small as rounding
# the activations to 8 bits or not moves other K/V codes and then log-probs by nats. llama.cpp's
# own q4_0 runs on the quantized weights and on the same weights dequantized to F32 (its activations
# then float; "f32_weights_ids", tests/parity/record_kv_quant_f32.py) part at steps 8, 17, 2, 3, 1, 1
# (SmolLM2) and 3, 3, 6, 1, 10, 8 (Gemma 3), their log-probs up to 1.8 nats apart before that; and
# llama.cpp rounds Q to 8 bits for its products with quantized K where ours keeps it float (the
# numpy reference with and without that rounding: 4.6 nats apart within agreeing steps). So a
# q4_0 case is held to llama.cpp's path only as far as llama.cpp's own path is determined: up to
# the step where its two runs part. (Once "one case per model may fail": SmolLM2's case 1 left
# llama.cpp's top 5 at step 19, past llama.cpp's own parting at 17.) TIE_TOL: at the first
# difference, llama.cpp's own near-tie within 0.25 nat is enough (seen: Gemma 3's case 4 at
# step 2 on an AMD Zen 4)
TIE_TOL = {"q8_0": 0.0, "q4_0": 0.25}


def determined(case: dict) -> dict:
    """The case up to the step where llama.cpp's q4_0 runs on quantized and on F32 weights part
    (at least its first step)."""
    want, other = case["greedy_ids"], case["f32_weights_ids"]
    n = max(1, next((i for i, (a, b) in enumerate(zip(want, other)) if a != b), len(want)))
    return dict(case, greedy_ids=want[:n], steps=case["steps"][:n])


@pytest.mark.parametrize("model,kv", CASES)
async def test_golden_generation(model, kv, request):
    """Every case passes (q4_0: as far as llama.cpp's own path is determined). Mutation: q4_0's
    cases whole and none allowed to fail, SmolLM2's case 1 fails at step 19."""
    path = request.getfixturevalue(FIXTURE[model])
    cases = REF[model][kv]["cases"]
    if kv == "q4_0":
        cases = [determined(c) for c in cases]
    await check_golden(path, "cpu", cases, top1_tol=TOP1_TOL_MODEL.get((model, kv), TOP1_TOL[kv]),
                       tie_tol=TIE_TOL[kv], every_step=False, kv_cache_type=kv)


# the suite's share of the time: Gemma 3's perplexity (10.12 q8_0, 11.88 q4_0 against llama.cpp's
# 10.14, 11.83, measured here) is left to a manual run; its goldens run above
PPL_CASES = [("smollm2-135m-instruct", "q8_0"), ("smollm2-135m-instruct", "q4_0"), ("qwen2.5-coder-0.5b-instruct", "q8_0")]


@pytest.mark.parametrize("model,kv", PPL_CASES)
async def test_perplexity(model, kv):
    """q8_0: within 1% of llama.cpp's with the same cache (Gemma 3 too, run by hand: -0.26%; it had
    2% once, for a ~0.8% drift of its fused graph that does not reproduce), and costing no more
    than 1% over what q8_0 costs llama.cpp against its f16 cache (0.2% SmolLM2, 0.4% Gemma 3, 5%
    Qwen2.5). q4_0 is a coarse rounding, each model's
    perplexity moving by several % with the rounding of single blocks, so its bound says "the same
    damage", not "the same value"; Qwen2.5's keys have outlier channels that q4_0 cannot hold (7.8x
    its f16 perplexity in llama.cpp, 9x in ours): not measured here, a ruin either way."""
    want = REF[model][kv]["ppl"]
    async with Session.open(str(_model(model)), n_ctx=512, kv_cache_type=kv) as s:
        assert s.stats()["kv_cache_type"] == kv
        ppl = summary(await chunk_nlls(s, TEXT, 512), 512)["ppl"]
    if kv == "q8_0":
        assert abs(ppl / want - 1) < 0.01, (model, kv, ppl, want)
        f16 = F16[model]["ppl"]
        assert ppl / f16 - 1 < want / f16 - 1 + 0.01, (model, ppl, want, f16)
    else:
        assert abs(ppl / want - 1) < 0.06, (model, kv, ppl, want)


TYPES = load_json("kv_types_ppl.json")["models"]
SUITE = [("smollm2-135m-instruct", "q4_0+rot")]
TABLE = [pytest.param(m, t, marks=() if (m, t) in SUITE else pytest.mark.long, id=f"{m}-{t}")
         for m in TYPES for t in TYPES[m]]


def tolerance(model: str, kv: str) -> float:
    """How far from llama.cpp's perplexity with the same type, by what the type's rounding does to
    this 4-chunk text (1,020 scored tokens); the largest measured in each class in brackets.
    Float and q8_0 types: 1% [0.71%]. 5-bit types 1% [0.85%], rotated 3% [Gemma 3: -2.11%, +2.03%].
    4-bit types 5% [Gemma 3 q4_0+rot +4.64%, iq4_nl+rot -4.48%; SmolLM2 iq4_nl+rot +4.39%]: single
    blocks' roundings move these, in either direction: rounding Q to 8 bits for the products with
    quantized K, as llama.cpp's kernel does (ours keeps Q float32), moved ours by +3.0% (SmolLM2
    q4_0, 20.46 -> 21.06) and -3.7% (SmolLM2 iq4_nl+rot, 17.82 -> 17.15 beside llama.cpp's 17.07),
    and llama.cpp's own q4_0 moved 3.4% between two hosts (20.75, 20.06). Qwen2.5 below 8 bits 20%
    [q4_0 +15.6%, iq4_nl +8.2%]: its keys' outlier channels make each of these a ruin in both (2 to
    11x its f16 perplexity), where one rounding swings a chunk by 0.8 nat."""
    base = kv.removesuffix(kv_types.ROT)
    if base in ("f16", "f32", "q8_0"):
        return 0.01
    if model == "qwen2.5-coder-0.5b-instruct":
        return 0.2
    if base in ("q4_0", "iq4_nl"):
        return 0.05
    return 0.03 if kv.endswith(kv_types.ROT) else 0.01


@pytest.mark.parametrize("model,kv", TABLE)
async def test_perplexity_beside_llama_cpp(model, kv):
    """Each KV type's perplexity beside llama.cpp's with the same type_k / type_v and rotation
    (tolerance, above); on SmolLM2 the rotation at least halves q4_0's loss over f16, as llama.cpp's
    does (its run: 20.06 plain, 17.18 rotated, f16 15.93; ours 20.46, 17.28, 15.94). Fails if the
    rotation is dropped from K or V (SmolLM2 q4_0+rot then reads 20.46, as plain), or a type's
    blocks are misread."""
    want = TYPES[model][kv]["ppl"]
    async with Session.open(str(_model(model)), n_ctx=512, kv_cache_type=kv) as s:
        assert s.stats()["kv_cache_type"] == kv
        ppl = summary(await chunk_nlls(s, TEXT, 512), 512)["ppl"]
    assert abs(ppl / want - 1) < tolerance(model, kv), (model, kv, ppl, want)
    if kv == "q4_0+rot" and model == "smollm2-135m-instruct":
        f16, plain = TYPES[model]["f16"]["ppl"], TYPES[model]["q4_0"]["ppl"]
        assert ppl - f16 < 0.5 * (plain - f16), (ppl, plain, f16)
