"""SmolLM2-135M-Instruct Q4_1 against llama.cpp's greedy outputs, on both CPU backends."""
import os

import pytest
from conftest import load_json
from golden import check_golden

# gpu_check.sh runs these with HEARTHLM_TEST_BACKENDS=cuda
BACKENDS = os.environ.get("HEARTHLM_TEST_BACKENDS", "cpu,reference").split(",")
F32 = load_json("golden_dequantized.json")["models"]["smollm2-135m-instruct"]["cases"]
GOLDEN = load_json("SmolLM2-135M-Instruct.Q4_1.visible.json")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_golden_generation(smollm2_path, backend):
    """Mutation: a 2% error in the attention scale (build_attn's `scale` times 1.02 or 0.98 in
    model_zoo/blocks.py) fails the reference backend's run in every case against the F32 record
    (log-probs off by 0.06-0.5 nats where 0.05 holds); the cpu run's int8 activations leave it
    within their own tolerance but for a case now and then."""
    assert len(GOLDEN["cases"]) == 6
    await check_golden(smollm2_path, backend, GOLDEN["cases"], dequantized=F32)
