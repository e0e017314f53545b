"""Gemma-3-270M Q4_K_M against llama.cpp's greedy outputs, on both CPU backends."""
import os

import pytest

from conftest import load_json
from golden import check_golden

# gpu_check.sh runs these with HEARTHLM_TEST_BACKENDS=cuda
# the numpy reference takes a minute or two here: `make test-long` (SmolLM2's runs in the suite)
BACKENDS = [pytest.param(b, marks=pytest.mark.long) if b == "reference" else b
            for b in os.environ.get("HEARTHLM_TEST_BACKENDS", "cpu,reference").split(",")]
GOLDEN = load_json("gemma-3-270m-q4_k_m.visible.json")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_golden_generation(gemma3_path, backend):
    assert len(GOLDEN["cases"]) == 6
    await check_golden(gemma3_path, backend, GOLDEN["cases"])
