"""Gemma-3-270M Q4_K_M against llama.cpp's greedy outputs, on both CPU backends."""
import os

import pytest
from conftest import load_json
from golden import check_golden

# gpu_check.sh runs these with HEARTHLM_TEST_BACKENDS=cuda
# the numpy reference takes a minute or two here: `make test-long` (SmolLM2's runs in the suite)
BACKENDS = [pytest.param(b, marks=pytest.mark.long) if b == "reference" else b
            for b in os.environ.get("HEARTHLM_TEST_BACKENDS", "cpu,reference").split(",")]
F32 = load_json("golden_dequantized.json")["models"]["gemma-3-270m"]["cases"]
GOLDEN = load_json("gemma-3-270m-q4_k_m.visible.json")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_golden_generation(gemma3_path, backend):
    """Mutation: a 2% error in the attention scale (build_attn's `scale` times 1.02 or 0.98 in
    model_zoo/blocks.py) fails the reference backend's run in every case against the F32 record
    (log-probs off by 0.06-0.5 nats where 0.05 holds); the cpu run's int8 activations leave it
    within their own tolerance but for a case now and then."""
    assert len(GOLDEN["cases"]) == 6
    await check_golden(gemma3_path, backend, GOLDEN["cases"], dequantized=F32)
