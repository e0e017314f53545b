"""A vision tower run in turns (runtime.vision_walk): stopped anywhere, a projection or attention's
queries in blocks of rows, it gives the rows of a run in one go, for every projector's tower."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.model_zoo.vision.clip import Slice, load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime import vision_walk
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import ImageBatch, VisionEncoder

DATA = Path(__file__).parent / "data" / "converted"
FAMILIES = ["gemma3", "gemma4", "lfm2", "mistral3", "qwen25vl", "qwen35", "qwen3vl", "smolvlm"]

def _media(vm) -> list[Media]:
    rgb = np.random.default_rng(7).integers(0, 256, (72, 96, 3), dtype=np.uint8)
    slices = [p for p in vm.layout(load_image(rgb)) if isinstance(p, Slice)]
    return [Media(start=0, n=s.n, key=s.key, pixels=s.pixels) for s in slices[:1]]

@pytest.mark.parametrize("family", FAMILIES)
def test_turns_give_the_whole_runs_rows(family, monkeypatch):
    """Turns of one block (32 rows) or one small kernel each, the rows equal (within float32's
    blocking noise) those of the whole graph in one run, and the big kernels did run in blocks
    (more turns than steps). Mutations: attention's block written at its absolute rows
    (out[r0:r1] in array_ops.attn_full), or MUL_MAT_ADD's residual left uncut, each fail it."""
    vm = load_mmproj(DATA / f"{family}-vision.mmproj.gguf")
    try:
        place = Placement.single(get_backend("cpu"), vm.config.n_layer)
        whole = _media(vm)
        VisionEncoder(vm, place, cache_bytes=0).fill(whole)
        monkeypatch.setattr(vision_walk, "MIN_ROWS", 32)
        enc = VisionEncoder(vm, place, cache_bytes=0)
        turned = _media(vm)
        _, h, w = turned[0].pixels.shape
        enc.want(turned)
        turns = 0
        while enc.pending:
            enc.advance(1e-12)  # at least one block or kernel: one a turn
            turns += 1
        n_steps = len(enc.graphs.get(ImageBatch(1, h, w)).steps)
        assert turns > n_steps, (turns, n_steps)
        for a, b in zip(whole, turned):

            np.testing.assert_allclose(b.rows, a.rows, rtol=1e-4, atol=1e-4 * float(np.abs(a.rows).max()))
    finally:
        vm.close()
