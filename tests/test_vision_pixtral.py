"""Image input (#39) on the tiny Mistral 3 vision-language model (tests/parity/hf spec "mistral3-vision", converted by
llama.cpp's convert_hf_to_gguf.py, text model and --mmproj: a pixtral projector with Mistral Small 3.1's patch
merger), against llama.cpp's libmtmd (tests/data/vision_parity_mistral3.json, recorded by
tests/parity/record_vision.py): the tower's rows ([IMG_BREAK]'s embedding among them), mtmd_tokenize's chunks (an
image then [IMG_END]), and the prompts' greedy steps and log-probs, the image rows decoded causally as libmtmd does."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core.graph import Graph, Op
from hearthlm.model_zoo.vision import pixtral
from hearthlm.model_zoo.vision.clip import load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402  (tests/golden.py: the parity criterion)
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
MODEL, MMPROJ = DATA / "converted" / "mistral3-vision.gguf", DATA / "converted" / "mistral3-vision.mmproj.gguf"
REF = json.loads((DATA / "vision_parity_mistral3.json").read_text())
ROWS_TOL = 1e-3  # image rows: max |ours - llama.cpp's| over the rows' largest magnitude (measured: 2.8e-4 to 4.1e-4)
LOGPROB_TOL = 0.05  # top-5 log-probs (nats), as the other families' (measured: 8e-4)


def _backends() -> list[str]:
    """reference and cpu, and cuda where HEARTHLM_TEST_BACKENDS names it (tests/gpu_check.sh's vision step)."""
    env = [n.strip() for n in os.environ.get("HEARTHLM_TEST_BACKENDS", "").split(",") if n.strip()]
    return env or ["cpu", "reference"]


@pytest.fixture(scope="module")
def tower():
    vm = load_mmproj(MMPROJ, n_embd_text=REF["n_embd"])
    yield vm
    vm.close()


def _prepared(vm, name: str):
    return vm.prepare(load_image(rgb(REF["images"][name]["recipe"])))


def _encode(vm, backend: str, media: list[Media]) -> None:
    enc = VisionEncoder(vm, Placement.single(get_backend(backend), vm.config.n_layer), slice_s=0.0)
    enc.want(media)
    while enc.pending:  # turns of one block of rows or one small kernel: the tower stopped everywhere
        enc.advance(1e-12)


def _break_at(n_rows: int, nx: int) -> np.ndarray:
    """Whether each of an image's rows is an [IMG_BREAK]: every (nx + 1)-th."""
    return (np.arange(n_rows) % (nx + 1)) == nx


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_tower_rows_match_llama_cpp(tower, backend, name):
    """Each image through the tower, in turns of a block or a kernel, gives llama.cpp's rows: the gradient (64x64: 16x16 patches,
    8x8 merged rows and 7 breaks), the noise (32x32: 4x4 and 3) and the wide one (44x26 resized to 48x24: 6x3 and 2).
    Mutations: the RoPE's halves by (column, row), the second half's frequencies not offset by base^(-2/d), the
    merger's columns read in build_merge's order (not unfold's), the merger's norm left out, attention scaled by 1,
    the FFN ungated (act(up)), or the breaks' rows unmasked (the merged row 0 plus the break), each fail it."""
    img = REF["images"][name]
    pixels, n, key = _prepared(tower, name)
    m = Media(0, n, key, pixels)
    _encode(tower, backend, [m])
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == tuple(img["shape"])
    err = np.abs(m.rows - want).max() / np.abs(want).max()
    assert err < ROWS_TOL, f"{backend} {name}: rows {err:.2e} off llama.cpp's"


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_breaks_are_the_files_embedding(tower, name):
    """The rows after each row of merged rows but the last are v.token_embd.img_break exactly, in ours and in
    llama.cpp's (6 digits); no other row is. Mutations: a break after the last row too, or the breaks' rows
    unmasked (the merged row 0 plus the break), each fail it."""
    brk = np.asarray(tower.file.tensors[pixtral.BREAK].raw()).view(np.float32)
    pixels, n, key = _prepared(tower, name)
    m = Media(0, n, key, pixels)
    _encode(tower, "cpu", [m])
    nx = pixels.shape[2] // (tower.config.patch_size * tower.pconfig.n_merge)
    at = _break_at(n, nx)
    assert at.sum() == pixels.shape[1] // (tower.config.patch_size * tower.pconfig.n_merge) - 1
    assert (m.rows[at] == brk).all() and not (m.rows[~at] == brk).all(axis=1).any()
    want = np.asarray(REF["images"][name]["rows"], np.float32)
    np.testing.assert_allclose(want[at], np.broadcast_to(brk, want[at].shape), rtol=1e-5)


def test_projector_reads_the_file(tower):
    """pixtral: spatial_merge_size 2 from the file with the merger and its norm, [IMG_BREAK]'s embedding, Pixtral's
    limits of 8 to 1024 rows (of 2x2 patches), the gated SiLU FFN (clip.use_silu), libmtmd's markers (no begin,
    [IMG_END]) and causal rows. Mutations: a default merge of 1, limits in patches (not merged rows), or BEGIN
    "[IMG]", each fail it."""
    c, pc = tower.config, tower.pconfig
    assert c.projector == "pixtral" and tower.proj is pixtral and c.act == "silu"
    area = (c.patch_size * pc.n_merge) ** 2
    assert (pc.n_merge, pc.merger, pc.breaks, pc.min_pixels, pc.max_pixels) == (2, True, True, 8 * area, 1024 * area)
    assert (pixtral.BEGIN, pixtral.END) == ("", "[IMG_END]")
    assert tower.bidirectional is REF["non_causal"] is False and REF["mrope"] is False


def test_merge_size_without_merger_refused(tower):
    """A spatial_merge_size over 1 in a file without mm.patch_merger is refused, naming both (clip.cpp would count
    merged rows and give unmerged ones). Mutation: no check fails it."""
    from hearthlm.core.errors import ModelLoadError
    weights = {k: v for k, v in tower.weights.items() if not k.startswith(pixtral.MERGER)}
    with pytest.raises(ModelLoadError, match="spatial_merge_size 2 needs mm.patch_merger.weight"):
        pixtral.Config.read(tower.config, {"clip.vision.spatial_merge_size": 2}, weights, "x")


def test_rope_2d_is_ggmls_two_ropes(tower):
    """The tower's 2D RoPE as clip.cpp's build_rope_2d: ggml_rope_ext (adjacent pairs) on the head's first half by
    the patch's row, then on its second half by its column with freq_scale base^(-2/d). Mutations: positions
    (column, row), or the second half's frequencies as the first's, each fail it."""
    n, h, d = 6, 2, tower.config.head_dim
    x = np.random.default_rng(0).standard_normal((n, h, d)).astype(np.float32)
    row, col = np.arange(n) // 3, np.arange(n) % 3
    g = Graph()
    xi, pi = g.input("x", (n, h, d), np.float32), g.input("rope_pos", (n, 2))
    q, _ = pixtral._rope(tower.config, g, pi)(xi, xi, 0)
    g.outputs.append(q)
    be, vals, feed = get_backend("reference"), {}, {"x": x, "rope_pos": np.stack([row, col], 1).astype(np.int32)}
    for node in g.nodes:  # the reference's kernels in order
        vals[id(node)] = feed[node.name] if node.op is Op.INPUT else be.bind(node)(*[vals[id(s)] for s in node.srcs])
    got = np.asarray(vals[id(g.outputs[0])])
    want = x.astype(np.float64).copy()
    b, m = pixtral.ROPE_BASE, d // 2
    for lo, p, scale in ((0, row, 1.0), (m, col, b ** (-2.0 / d))):  # ggml_rope_ext, n_dims d/2, mode 0
        a = p[:, None, None] * scale * b ** (-2.0 * np.arange(m // 2) / m)  # (n, 1, m/2)
        x0, x1 = x[..., lo:lo + m:2], x[..., lo + 1:lo + m:2]
        want[..., lo:lo + m:2] = x0 * np.cos(a) - x1 * np.sin(a)
        want[..., lo + 1:lo + m:2] = x0 * np.sin(a) + x1 * np.cos(a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_images_of_one_size_encode_together(tower):
    """Two images of one size in one graph give what each gives alone (RoPE positions, the merger's order and the
    breaks' rows per image). Mutation: the breaks' source rows of the first image only (not offset per image)
    fails it."""
    a, n, _ = _prepared(tower, "gradient")
    b = tower.prepare(load_image(rgb(dict(REF["images"]["noise"]["recipe"], nx=64, ny=64))))[0]
    alone = []
    for k, px in ((b"a", a), (b"b", b)):
        m = Media(0, n, k, px)
        _encode(tower, "cpu", [m])
        alone.append(m.rows)
    both = [Media(0, n, b"a", a), Media(0, n, b"b", b)]
    enc = VisionEncoder(tower, Placement.single(get_backend("cpu"), tower.config.n_layer), slice_s=0.0)
    enc.fill(both)
    assert enc.images_encoded == 2
    for m, want in zip(both, alone):
        np.testing.assert_allclose(m.rows, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_preprocessed_size_is_mtmds(tower, name):
    """The prepared image's row count is mtmd's image chunk's n_tokens (= n_pos), breaks included. Mutation: no
    break rows counted fails it."""
    chunks = {im: c for p in REF["prompts"].values()
              for c, im in zip([c for c in p["chunks"] if c["type"] == "image"], p["images"])}
    _, n, _ = _prepared(tower, name)
    assert n == chunks[name]["n_tokens"] == chunks[name]["n_pos"]


# ---- the text model: image rows in Ministral 3 ----------------------------------------------

def _images_of(case) -> list[np.ndarray]:
    return [rgb(REF["images"][k]["recipe"]) for k in case["images"]]


@pytest.fixture(scope="module", params=["cpu", "reference"])
def vision_session(request):
    """The tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record, 64-token steps (the 71-row
    image is computed whole)."""
    from hearthlm import SyncSession
    s = SyncSession(str(MODEL), backend=request.param, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield s
    s.close()


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks (BOS, text, a placeholder per row, breaks included, [IMG_END],
    text), causal. Mutation: END "[IMG_BREAK]" fails it."""
    case, s = REF["prompts"][name], vision_session.session
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case))
    want = [t for ch in case["chunks"] for t in (ch["tokens"] if ch["type"] == "text" else [None] * ch["n_tokens"])]
    assert [t if t >= 0 else None for t in ids] == want
    assert [m.n for m in media] == [ch["n_tokens"] for ch in case["chunks"] if ch["type"] == "image"]
    assert not any(m.bidirectional for m in media)



@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (0.05 nats) on prompts with one image, two, an image between text,
    and 300+ tokens of text after one, as libmtmd computes them (measured: 8e-4 nats at most, cpu and reference).
    Mutations: the image rows both ways, or the file's [IMG_BREAK] ignored (no break rows), each fail it."""
    case = REF["prompts"][name]
    with pytest.MonkeyPatch.context() as mp:
        c = vision_session.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                                    temperature=0, top_logprobs=5)
        mp.setattr(golden, "TOP1_LOGPROB_TOL", LOGPROB_TOL)
        why = golden.compare_top5(case, c, LOGPROB_TOL)
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    assert why is None, why


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_text_side_with_llama_cpps_rows(backend):
    """llama.cpp's own image rows (in a fresh session's encoder cache under the images' keys) give its log-probs
    within 0.01 nats at every step of every prompt: the text side is llama.cpp's. Mutation: the image rows both
    ways fails it."""
    from hearthlm import SyncSession
    failures = []
    with SyncSession(str(MODEL), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64) as ss:
        s = ss.session
        enc = s.engine.runner.vision
        for k, im in REF["images"].items():
            enc.cache.put(_prepared(s.vision, k)[2], np.asarray(im["rows"], np.float32))
        for name, case in REF["prompts"].items():
            c = ss.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            why = golden.compare_top5(case, c, 0.01)
            if why:
                failures.append(f"{name}: {why}")
        assert enc.images_encoded == 0 and enc.cache.misses == 0
    assert not failures, "\n".join(failures)


def test_without_merger_rows_are_patches(tower, monkeypatch):
    """Pixtral-12B's form (no merger, spatial merge 1): a row per patch, a break after each row of patches but the
    last; the MLP takes the tower's width. Mutation: the merger run whatever the file has fails it."""
    import dataclasses
    monkeypatch.setattr(tower, "pconfig", dataclasses.replace(tower.pconfig, n_merge=1, merger=False))
    pixels, n, key = _prepared(tower, "noise")  # 32x32: 8x8 patches
    assert pixels.shape == (3, 32, 32) and n == 8 * 8 + 7
    m = Media(0, n, key, pixels)
    _encode(tower, "cpu", [m])
    assert m.rows.shape == (71, REF["n_embd"]) and np.isfinite(m.rows).all()
    assert (m.rows[_break_at(n, 8)] == np.asarray(tower.file.tensors[pixtral.BREAK].raw()).view(np.float32)).all()
