"""Gemma-3-270M Q4_K_M against llama.cpp's greedy outputs, on both CPU backends."""
import pytest

from conftest import load_json
from golden import check_golden

GOLDEN = load_json("gemma-3-270m-q4_k_m.visible.json")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
async def test_golden_generation(gemma3_path, backend):
    assert len(GOLDEN["cases"]) == 6
    await check_golden(gemma3_path, backend, GOLDEN["cases"])
