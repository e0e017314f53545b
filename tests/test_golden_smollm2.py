"""SmolLM2-135M-Instruct Q4_1 against llama.cpp's greedy outputs, on both CPU backends."""
import os

import pytest

from conftest import load_json
from golden import check_golden

# gpu_check.sh runs these with HEARTHLM_TEST_BACKENDS=cuda
BACKENDS = os.environ.get("HEARTHLM_TEST_BACKENDS", "cpu,reference").split(",")
GOLDEN = load_json("SmolLM2-135M-Instruct.Q4_1.visible.json")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_golden_generation(smollm2_path, backend):
    assert len(GOLDEN["cases"]) == 6
    await check_golden(smollm2_path, backend, GOLDEN["cases"])
