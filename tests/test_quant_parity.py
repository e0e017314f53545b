"""The weight types the Hub ships, end to end against llama.cpp: a tiny llama (256-wide rows, whole
super-blocks) quantized by llama.cpp's own quantizer to each type (tests/data/quant/*.gguf), and
llama.cpp's greedy steps and top-5 log-probs on it (tests/parity/record_quant_types.py, with
llama-cpp-python 0.3.36). Quantized weights and int8 activations make llama.cpp's own result move
with its settings, so the cpu backend's tolerance is derived from that: llama.cpp's top-1
log-probs under flash attention on and off and f32 K/V, against its defaults, over the steps where
the greedy tokens agree; this test allows each type twice that spread, and at least 0.05 nat, on
the cpu backend, which quantizes activations to int8 as llama.cpp does. The numpy reference keeps
them float: it is held to llama.cpp's run on the same weights dequantized to F32 (each case's
"f32_weights", tests/parity/record_quant_f32.py), top 5 within 0.05 nat at every step (measured:
0.005 at most; against the quantized run it is off by up to 0.38 nat on the ternary types, which
is llama.cpp's own 8-bit rounding: its quantized run is 0.384 from its F32 one there)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hearthlm import Session

sys.path.insert(0, str(Path(__file__).parent))
import golden  # noqa: E402

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "quant_parity.json").read_text())
REFERENCE_TOL = 0.05  # the numpy reference against llama.cpp on F32 weights (measured <= 0.005 top 1)


def tolerance(cases: list[dict]) -> float:
    """Twice the largest move of llama.cpp's own top-1 log-prob across its variants, at least 0.05."""
    spread = 0.0
    for c in cases:
        base = [s["top_logprobs"][0] for s in c["steps"]]
        for v in c["variants"].values():
            n = next((i for i, (a, b) in enumerate(zip(v["greedy_ids"], c["greedy_ids"])) if a != b),
                     min(len(v["greedy_ids"]), len(c["greedy_ids"])))
            spread = max([spread] + [abs(x - y) for x, y in zip(v["top1_logprobs"][:n], base[:n])])
    return max(0.05, 2 * spread)


def test_the_recorded_files_are_of_their_types():
    import gguf
    for name in RECORDED:
        want = {"Q4_K_M": "Q4_K", "IQ3_M": "IQ3_S"}.get(name, name)
        types = {t.tensor_type.name for t in gguf.GGUFReader(str(DATA / "quant" / f"{name}.gguf")).tensors}
        assert want in types, (name, types)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", sorted(RECORDED))
async def test_matches_llama_cpp(name, backend):
    """Mutation: the reference held to the quantized run with the cpu's tolerance fails on TQ1_0
    and TQ2_0 (0.382 against 0.367), as with twice it (as it was) a 2% attention-scale error passes."""
    cases, tol = RECORDED[name], tolerance(RECORDED[name])
    failures = []
    async with Session.open(str(DATA / "quant" / f"{name}.gguf"), backend=backend, n_ctx=256) as s:
        for i, case in enumerate(cases):
            c = await s.generate(case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0, top_logprobs=5)
            if backend == "reference":
                why = golden.compare(case["f32_weights"], c.token_ids, c.top_logprobs, c.finish_reason,
                                     top1_tol=REFERENCE_TOL, topk_tol=REFERENCE_TOL)
                if why:
                    failures.append(f"prompt {i} against llama.cpp on F32 weights: {why}")
                continue
            why = golden.compare(case, c.token_ids, c.top_logprobs, c.finish_reason, top1_tol=tol)  # top 1, every step
            if why:
                failures.append(f"prompt {i}: {why}")
    assert not failures, "\n".join(failures)
