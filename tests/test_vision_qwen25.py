"""Image input (#39) on a tiny Qwen2.5-VL (tests/parity/hf spec "qwen25vl-vision", converted by llama.cpp's
convert_hf_to_gguf.py, text model "qwen2vl" and --mmproj "qwen2.5vl_merger"), against llama.cpp's libmtmd
(tests/data/vision_parity_qwen25vl.json, recorded by tests/parity/record_vision.py): the tower's rows with
window attention (patch 14: windows of 4x4 merged rows, smaller than the 8x8 and 9x5 grids; full attention in
layers 1 and 3), mtmd_tokenize's chunks with their M-RoPE positions, and the prompts' greedy steps and log-probs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.model_zoo.vision import qwen25vl
from hearthlm.model_zoo.vision.clip import load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media, rope_positions
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402  (tests/golden.py: the parity criterion)
from record_vision import rgb  # noqa: E402

DATA = Path(__file__).parent / "data"
MODEL, MMPROJ = DATA / "converted" / "qwen25vl-vision.gguf", DATA / "converted" / "qwen25vl-vision.mmproj.gguf"
REF = json.loads((DATA / "vision_parity_qwen25vl.json").read_text())
ROWS_TOL = 1e-3  # max |ours - llama.cpp's| over the rows' largest (ggml-cpu's F16 GELU table: ~4e-4)
LOGPROB_TOL = 0.01  # nats, top-5 at every step: measured 0.0035 at most (the rows' GELU-table difference)


@pytest.fixture(scope="module")
def tower():
    vm = load_mmproj(MMPROJ, n_embd_text=REF["n_embd"])
    yield vm
    vm.close()


def _prepared(vm, name: str):
    return vm.prepare(load_image(rgb(REF["images"][name]["recipe"])))


def _encode(vm, backend: str, *media):
    enc = VisionEncoder(vm, Placement.single(get_backend(backend), vm.config.n_layer), slice_s=0.0)
    enc.want(list(media))
    while enc.pending:  # turns of one block of rows or one small kernel: the tower stopped everywhere
        enc.advance(1e-12)
    return enc


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_tower_rows_match_llama_cpp(tower, backend, name):
    """Each image through the tower gives llama.cpp's rows: the gradient (224x224: 8x8 rows in four windows), the
    noise (112x112: 4x4 rows, one window) and the wide one (260x150 resized to 252x140: 9x5 rows, windows cut to
    4x1, 1x4 and 1x1 at the edges), the tower run in turns of a block or a kernel. Mutations: windows ignored (every layer over
    the whole image), the full-attention layers windowed too, the rows left in window order (no window_idx), the
    RoPE positions in raster order, or the FFN's gate and up swapped, each fail it. (Windows taken column-major
    give the same rows: test_windows_are_clip_cpps holds their order.)"""
    img = REF["images"][name]
    pixels, n, key = _prepared(tower, name)
    m = Media(0, n, key, pixels)
    _encode(tower, backend, m)
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == tuple(img["shape"])
    err = np.abs(m.rows - want).max() / np.abs(want).max()
    assert err < ROWS_TOL, f"{backend} {name}: {err:.2e} off llama.cpp's"


def test_projector_reads_the_file(tower):
    """qwen2.5vl_merger: merge 2, Qwen-VL's limits of 8 to 4096 rows, n_wa_pattern 2 (layers 1 and 3 full),
    windows of 112 pixels (4 rows at patch 14), the markers and causal rows libmtmd uses. Mutations: full
    attention where il % n_wa_pattern == 0, or a window of 112 patches, each fail it."""
    c, pc = tower.config, tower.pconfig
    assert c.projector == "qwen2.5vl_merger" and tower.proj is qwen25vl and c.act == "silu"
    area = (c.patch_size * pc.n_merge) ** 2
    assert (pc.n_merge, pc.min_pixels, pc.max_pixels, pc.n_wa_pattern, pc.window) == (2, 8 * area, 4096 * area, 2, 4)
    assert [il for il in range(c.n_layer) if pc.full(il)] == [1, 3]
    assert (qwen25vl.BEGIN, qwen25vl.END) == ("<|vision_start|>", "<|vision_end|>")
    assert tower.bidirectional is REF["non_causal"] is False and REF["mrope"] is True


def test_projector_needs_the_window_pattern(tower):
    """Metadata without clip.vision.n_wa_pattern (clip.cpp requires it of this projector) is refused, named.
    Mutation: a default of 0 (no windows) fails it."""
    from hearthlm.core.errors import ModelLoadError
    md = {k: v for k, v in tower.file.metadata.items() if k != "clip.vision.n_wa_pattern"}
    with pytest.raises(ModelLoadError, match="n_wa_pattern"):
        qwen25vl.Config.read(tower.config, md, dict(tower.weights), "x.gguf")
    assert qwen25vl.Config.read(tower.config, tower.file.metadata, dict(tower.weights), "x.gguf") == tower.pconfig


def test_windows_are_clip_cpps():
    """The merged rows window by window, each window's rows row-major, windows cut at the grid's edges (clip.cpp's
    inv_window_idx), numbered in order. Mutation: windows column-major fails it."""
    order, win = qwen25vl.windows(3, 5, 2)  # 3 rows of 5: windows 2x2, 2x2, 2x1 / 1x2, 1x2, 1x1
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert win.tolist() == [0] * 4 + [1] * 4 + [2] * 2 + [3] * 2 + [4] * 2 + [5]


@pytest.mark.parametrize("side", [224, 112])
def test_images_of_one_size_encode_together(tower, side):
    """Two images of one size in one graph give what each gives alone (patch indices, windows and the rows' way
    back offset to each image; attention within its windows or itself): four windows each, or one (the two
    images' windows then adjacent runs). Mutations: win_seg or window_idx not offset past the first image each
    fail it."""
    rng = np.random.default_rng(5)
    a, b = (tower.prepare(load_image(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)))[0] for _ in range(2))
    n = (side // 28) ** 2
    alone = []
    for k, px in ((b"a", a), (b"b", b)):
        m = Media(0, n, k, px)
        _encode(tower, "cpu", m)
        alone.append(m.rows)
    both = [Media(0, n, b"a", a), Media(0, n, b"b", b)]
    assert _encode(tower, "cpu", *both).images_encoded == 2
    for m, want in zip(both, alone):
        np.testing.assert_allclose(m.rows, want, rtol=1e-4, atol=1e-5)


# ---- the text model (qwen2vl: M-RoPE sections in runs) ------------------------------------

def _images_of(case) -> list[np.ndarray]:
    return [rgb(REF["images"][k]["recipe"]) for k in case["images"]]


@pytest.fixture(scope="module", params=["cpu", "reference"])
def vision_session(request):
    """The tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record; 64-token steps."""
    from hearthlm import SyncSession
    s = SyncSession(str(MODEL), backend=request.param, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield s
    s.close()


def test_text_model_reads_mrope_sections():
    """qwen2vl: qwen2 (Q/K/V biases) with M-RoPE "mrope", sections (2, 3, 3, 0) in runs; a "rope_pos" input of 4
    components. Mutation: the architecture missing from the registry fails it."""
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime.batch import one_token
    m = load_model(MODEL)
    try:
        r = m.config.rope
        assert m.config.MROPE == "mrope" and m.n_pos == 4
        assert "rope_pos" in m.build_graph(one_token()).inputs, r
    finally:
        m.close()


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_and_positions_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks and each token's M-RoPE position components as llama.cpp decodes
    them: text at (p, p, p, 0), an image's rows at (p0, p0 + y, p0 + x, 0), the text after it at p0 + max(nx, ny).
    Mutation: an image advancing the position by its row count fails it."""
    case, s = REF["prompts"][name], vision_session.session
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case))
    want_ids, want_pos, p = [], [], 0
    for ch in case["chunks"]:
        if ch["type"] == "text":
            want_ids += ch["tokens"]
            want_pos += [[p + i] * 3 + [0] for i in range(len(ch["tokens"]))]
        else:
            want_ids += [None] * ch["n_tokens"]
            want_pos += ch["positions"]
        p += ch["n_pos"]
    assert [t if t >= 0 else None for t in ids] == want_ids
    got = rope_positions(media, 0, len(ids))
    assert got.tolist() == want_pos and got[-1, 0] + 1 == case["n_past"] == p



@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (LOGPROB_TOL) on prompts with one image, two, an image between text,
    and 306 tokens of text after one, as libmtmd computes them. Mutations: the tower's windows ignored, or the
    text model's M-RoPE interleaved ("imrope"), each fail it."""
    case = REF["prompts"][name]
    c = vision_session.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                                temperature=0, top_logprobs=5)
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(golden, "TOP1_LOGPROB_TOL", LOGPROB_TOL)
        why = golden.compare_top5(case, c, LOGPROB_TOL)
    assert why is None, why


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_text_side_with_llama_cpps_rows(backend):
    """llama.cpp's own image rows (in the encoder cache under the images' keys) give its log-probs within 0.01
    nats at every step of every prompt: the text side (M-RoPE in runs, positions, causal rows) is llama.cpp's.
    Mutations: the sections interleaved ("imrope"), or the rows' h and w components swapped, each fail it."""
    from hearthlm import SyncSession
    with SyncSession(str(MODEL), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64) as ss:
        s = ss.session
        enc = s.engine.runner.vision
        for k, im in REF["images"].items():
            enc.cache.put(_prepared(s.vision, k)[2], np.asarray(im["rows"], np.float32))
        failures = []
        for name, case in REF["prompts"].items():
            c = ss.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            why = golden.compare_top5(case, c, 0.01)
            if why:
                failures.append(f"{name}: {why}")
        assert enc.images_encoded == 0 and enc.cache.misses == 0
    assert not failures, "\n".join(failures)
