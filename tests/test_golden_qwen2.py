"""Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: Q/K/V biases, NeoX RoPE) against llama.cpp's
greedy outputs, on both CPU backends."""
import os

import pytest

from conftest import load_json
from golden import check_golden

# gpu_check.sh runs these with HEARTHLM_TEST_BACKENDS=cuda
BACKENDS = os.environ.get("HEARTHLM_TEST_BACKENDS", "cpu,reference").split(",")
GOLDEN = load_json("qwen2.5-coder-0.5b-instruct.visible.json")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_golden_generation(qwen2_path, backend):
    assert len(GOLDEN["cases"]) == 6
    await check_golden(qwen2_path, backend, GOLDEN["cases"])
