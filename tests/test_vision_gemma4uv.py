"""Image input (#39) on a tiny Gemma 4 12B-like model (tests/parity/hf spec "gemma4uv-vision":
Gemma4UnifiedForConditionalGeneration converted by llama.cpp's convert_hf_to_gguf.py, text model and --mmproj: the
encoder-free gemma4uv projector), against llama.cpp's libmtmd (tests/data/vision_parity_gemma4uv.json, recorded by
tests/parity/record_vision.py gemma4uv): the projector's rows, mtmd_tokenize's chunks, and the prompts' greedy steps
and log-probs with the image rows decoded both ways in the sliding layers (libmtmd does so for gemma4uv at any text
width). The text model alone: tests/test_converted.py (gemma4uv-vision)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core.errors import InvalidRequestError, ModelLoadError
from hearthlm.model_zoo.vision import gemma4uv
from hearthlm.model_zoo.vision.clip import load_mmproj, read_config
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
MODEL, MMPROJ = DATA / "converted" / "gemma4uv-vision.gguf", DATA / "converted" / "gemma4uv-vision.mmproj.gguf"
REF = json.loads((DATA / "vision_parity_gemma4uv.json").read_text())
# image rows: max |ours - llama.cpp's| over the rows' largest magnitude; tighter than the towers' 1e-3, as no F16
# enters here (measured: 2.7e-6 at most; the LayerNorms at eps 1e-6 give 5.8e-4)
ROWS_TOL = 1e-4
LOGPROB_TOL = 0.01  # top-5 log-probs (nats); F32 everywhere, no F16 patch embedding (measured: see the report)


@pytest.fixture(scope="module")
def tower():
    vm = load_mmproj(MMPROJ, n_embd_text=REF["n_embd"])
    yield vm
    vm.close()


def _prepared(vm, name: str):
    return vm.prepare(load_image(rgb(REF["images"][name]["recipe"])))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_rows_match_llama_cpp(tower, backend, name):
    """Each image through the projector gives llama.cpp's rows: the gradient (64x64) and the noise (32x32)
    upscaled to 108x108 (9x9 patches of 12: the 70-row minimum), the wide one (40x24) to 132x84 (11x7).
    Mutations: the patches at half precision (conv_2d's), the x and y tables swapped, patch_norm.1 left out, the
    LayerNorms at the file's eps (1e-6), or the RMS norm before the projection left out, each fail it. (Pixels
    scaled to 2x - 1 as gemma4v's would pass: patch_norm.1 normalizes each patch, so an affine scaling is
    invisible.)"""
    img = REF["images"][name]
    pixels, n, key = _prepared(tower, name)
    enc = VisionEncoder(tower, Placement.single(get_backend(backend), tower.config.n_layer), slice_s=0.0)
    m = Media(0, n, key, pixels)
    enc.fill([m])
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == tuple(img["shape"])
    err = np.abs(m.rows - want).max() / np.abs(want).max()
    assert err < ROWS_TOL, f"{backend} {name}: rows {err:.2e} off llama.cpp's"


def test_projector_reads_the_file(tower):
    """gemma4uv: no layers, patches of patch_size x 3 (clip.cpp's patch_size *= n_merge; no scale_factor in the
    file), Gemma 4's 70 to 1120 rows over those patches, 64-row position tables, libmtmd's markers, rows both ways
    whatever the text width (E2B's 1536 too). Mutations: the patch left at patch_size (4), the limits over
    patch x 3 again, or gemma4v's width rule for causality, each fail it."""
    c, pc = tower.config, tower.pconfig
    assert c.projector == "gemma4uv" and tower.proj is gemma4uv and c.n_layer == 0
    assert (pc.patch, pc.min_pixels, pc.max_pixels, pc.n_pos) == (12, 70 * 144, 1120 * 144, 64)
    assert (gemma4uv.BEGIN, gemma4uv.END) == ("<|image>", "<image|>")
    assert tower.bidirectional is REF["non_causal"] is True and REF["mrope"] is False
    tower.n_embd_out = 1536
    try:
        assert tower.bidirectional is True
    finally:
        tower.n_embd_out = REF["n_embd"]


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_preprocessed_size_is_mtmds(tower, name):
    """The prepared image's row count is mtmd's image chunk's n_tokens (= n_pos). Mutation: the 70-row minimum
    as 64 fails the gradient (8x8)."""
    chunks = {im: c for p in REF["prompts"].values()
              for c, im in zip([c for c in p["chunks"] if c["type"] == "image"], p["images"])}
    _, n, _ = _prepared(tower, name)
    assert n == chunks[name]["n_tokens"] == chunks[name]["n_pos"]


def test_images_of_one_size_encode_together(tower):
    """Two images of one size in one graph give what each gives alone. Mutation: the positions of the first
    image only (not tiled per image) fails it."""
    prepared = [_prepared(tower, k) for k in ("gradient", "noise")]
    alone = []
    for px, n, key in prepared:
        m = Media(0, n, key, px)
        VisionEncoder(tower, Placement.single(get_backend("cpu"), 0)).fill([m])
        alone.append(m.rows)
    both = [Media(0, n, key, px) for px, n, key in prepared]
    enc = VisionEncoder(tower, Placement.single(get_backend("cpu"), 0))
    enc.fill(both)
    assert enc.images_encoded == 2
    for m, want in zip(both, alone):
        np.testing.assert_allclose(m.rows, want, rtol=1e-5, atol=1e-6)


def test_image_past_the_position_tables_refused(tower, monkeypatch):
    """An image whose resized grid is wider than the position tables is refused, naming both. Mutation: no check
    fails it."""
    import dataclasses
    monkeypatch.setattr(tower, "pconfig", dataclasses.replace(tower.pconfig, n_pos=10))
    tower.prepare(load_image(rgb(REF["images"]["gradient"]["recipe"])))  # 9x9 patches: fits
    with pytest.raises(InvalidRequestError, match="11x7 patches .* hold 10 a side"):
        tower.prepare(load_image(rgb(REF["images"]["wide"]["recipe"])))


def test_audio_half_refused_by_name(tmp_path):
    """The file's audio projector (gemma4ua) is refused by name, as a vision projector type or as an audio-only
    file's. Mutations: gemma4ua left out of clip.AUDIO fails the first ("unknown vision projector"); the
    projector type read from the vision keys only fails the second ("(none)")."""
    from gguf_edit import copy_with_string
    bad = copy_with_string(MMPROJ, tmp_path / "mmproj.gguf", "clip.vision.projector_type", "gemma4ua")
    with pytest.raises(ModelLoadError, match="'gemma4ua' is an audio tower"):
        load_mmproj(bad)
    audio_only = {"clip.has_vision_encoder": False, "clip.has_audio_encoder": True,
                  "clip.audio.projector_type": "gemma4ua"}
    with pytest.raises(ModelLoadError, match="an audio mmproj \\(projector 'gemma4ua'\\)"):
        read_config(audio_only, "x.gguf")


def _metadata() -> dict:
    from hearthlm.model_zoo.gguf_file import GGUFFile
    f = GGUFFile.open(MMPROJ)
    try:
        return dict(f.metadata)
    finally:
        f.close()


def test_layers_in_a_towerless_file_refused():
    """A gemma4uv file that says it has layers is refused, naming the projector; a tower with none is not a
    tower. Mutation: the no-tower check skipped fails the first."""
    md = _metadata()
    with pytest.raises(ModelLoadError, match="block_count 2: the gemma4uv projector has no layers"):
        read_config({**md, "clip.vision.block_count": 2}, "x.gguf")
    with pytest.raises(ModelLoadError, match="does not divide"):
        read_config({**md, "clip.vision.projector_type": "gemma4v"}, "x.gguf")


# ---- the text model with the rows ------------------------------------------------------------

@pytest.fixture(scope="module", params=["cpu", "reference"])
def vision_session(request):
    """The tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record, 64-token steps (an image of
    81 rows is computed whole)."""
    from hearthlm import SyncSession
    s = SyncSession(str(MODEL), backend=request.param, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield s
    s.close()


def _images_of(case) -> list[np.ndarray]:
    return [rgb(REF["images"][k]["recipe"]) for k in case["images"]]


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks (BOS, text, <|image>, a placeholder per row, <image|>, text),
    each image of as many rows as its chunk, both ways. Mutation: BEGIN and END swapped fails it."""
    case, s = REF["prompts"][name], vision_session.session
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case))
    want = [t for ch in case["chunks"] for t in (ch["tokens"] if ch["type"] == "text" else [None] * ch["n_tokens"])]
    assert [t if t >= 0 else None for t in ids] == want
    assert [m.n for m in media] == [ch["n_tokens"] for ch in case["chunks"] if ch["type"] == "image"]
    assert all(m.bidirectional for m in media)


def _deviation(want, c) -> float:
    """The largest |ours - llama.cpp's| over the top-5 log-probs of the steps both took (a token of llama.cpp's
    top-5 missing from ours counts as infinite)."""
    worst = 0.0
    for step, (ours, w) in enumerate(zip(c.top_logprobs, want["steps"])):
        mine = dict(ours)
        worst = max([worst, *(abs(mine[t] - lp) if t in mine else np.inf for t, lp in zip(w["top_ids"],
                                                                                            w["top_logprobs"]))])
        if step >= len(c.token_ids) or c.token_ids[step] != want["greedy_ids"][step]:
            break
    return worst


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name, monkeypatch):
    """Greedy steps, top-5 and their log-probs (0.01 nats) on prompts with one image, two, an image between text,
    and 335 tokens of text after one, as libmtmd computes them (rows both ways in the sliding layers). Mutations:
    the rows causal (gemma4v's E2B rule), the full layers attending both ways too, or the rows scaled by
    sqrt(n_embd) as tokens are, each fail it."""
    import golden
    case = REF["prompts"][name]
    c = vision_session.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                                temperature=0, top_logprobs=5)
    monkeypatch.setattr(golden, "TOP1_LOGPROB_TOL", LOGPROB_TOL)
    why = golden.compare(case, c.token_ids, c.top_logprobs, c.finish_reason)
    dev = _deviation(case, c)
    print(f"{name}: top-5 log-prob deviation {dev:.2e}, greedy {c.token_ids == case['greedy_ids']}")
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    assert why is None and dev <= LOGPROB_TOL, why or f"top-5 log-probs {dev:.3f} nats off llama.cpp's"
