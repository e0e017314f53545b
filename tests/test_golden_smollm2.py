"""SmolLM2-135M-Instruct Q4_1 against llama.cpp's greedy outputs, on both CPU backends."""
import pytest

from conftest import load_json
from golden import check_golden

GOLDEN = load_json("SmolLM2-135M-Instruct.Q4_1.visible.json")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
async def test_golden_generation(smollm2_path, backend):
    assert len(GOLDEN["cases"]) == 6
    await check_golden(smollm2_path, backend, GOLDEN["cases"])
