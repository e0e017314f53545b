"""Image input (#39) on the tiny Gemma 4 vision-language model (tests/parity/hf spec "gemma4-vision", converted by
llama.cpp's convert_hf_to_gguf.py, text model and --mmproj: a gemma4v projector), against llama.cpp's libmtmd
(tests/data/vision_parity_gemma4.json, recorded by tests/parity/record_vision.py): the tower's rows, mtmd_tokenize's
chunks, and the prompts' greedy steps and log-probs, with the image rows decoded as libmtmd decodes this model's
(both ways: its text model is 32 wide; Gemma 4 applies that to its sliding layers only) and as it decodes E2B's and
E4B's (causally; the record's "causal" steps)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core.errors import InvalidRequestError
from hearthlm.core.graph import Graph, Op
from hearthlm.model_zoo.vision import gemma4v
from hearthlm.model_zoo.vision.clip import load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402  (tests/golden.py: the parity criterion)
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
MODEL, MMPROJ = DATA / "converted" / "gemma4-vision.gguf", DATA / "converted" / "gemma4-vision.mmproj.gguf"
REF = json.loads((DATA / "vision_parity_gemma4.json").read_text())
ROWS_TOL = 1e-3  # image rows: max |ours - llama.cpp's| over the rows' largest magnitude (measured: 2.5e-4 to 5.5e-4)
# Log-probs of the top-5 (nats). ggml-cpu's GELU-quick reads a float16 table, so llama.cpp's rows differ from ours
# by ~5e-4 of their largest; the tiny model turns that into 0.008 nats at most (one_image, both ways).
# test_text_side_with_llama_cpps_rows holds the text side to 0.01 on llama.cpp's own rows.
LOGPROB_TOL = 0.05


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


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_tower_rows_match_llama_cpp(tower, backend, name):
    """Each image through the tower, in turns of a block or a kernel, gives llama.cpp's rows: the gradient (64x64) and the noise
    (32x32) upscaled to 108x108 (27x27 patches, 9x9 rows: Gemma 4's 70-row minimum), the wide one (40x24) to
    132x84 (11x7 rows). Mutations: pixels not scaled to 2x - 1, the RoPE's halves by (row, column), the clamps
    left out, V not RMS-normed, attention scaled by head_dim^-1/2, std_bias/std_scale left out, or the pooled
    rows not times sqrt(n_embd), each fail it."""
    img = REF["images"][name]
    pixels, n, key = _prepared(tower, name)
    enc = VisionEncoder(tower, Placement.single(get_backend(backend), tower.config.n_layer), slice_s=0.0)
    m = Media(0, n, key, pixels)
    enc.want([m])
    while enc.pending:  # turns of one block of rows or one small kernel: the tower stopped everywhere
        enc.advance(1e-12)
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == tuple(img["shape"])
    err = np.abs(m.rows - want).max() / np.abs(want).max()
    assert err < ROWS_TOL, f"{backend} {name}: rows {err:.2e} off llama.cpp's"


def test_projector_reads_the_file(tower):
    """gemma4v: pooling 3 (clip.cpp's default; no scale_factor in the file), Gemma 4's limits of 70 to 1120 rows,
    64-row position tables, the bounds of all 14 clipped linears (7 a layer: Q, K, V, out, gate, up, down; the
    input projection has none), GELU-quick (the converter writes no clip.use_gelu), libmtmd's markers, and the
    recorded non-causal rows of a 32-wide text model. Mutations: a default pooling of 2, the clamps read from
    ".input_max" for both input bounds, or BEGIN "<start_of_image>", each fail it."""
    c, pc = tower.config, tower.pconfig
    assert c.projector == "gemma4v" and tower.proj is gemma4v and c.act == "gelu_quick"
    area = (c.patch_size * pc.n_merge) ** 2
    assert (pc.n_merge, pc.min_pixels, pc.max_pixels, pc.n_pos) == (3, 70 * area, 1120 * area, 64)
    assert len(pc.clamps) == 14 and "mm.input_projection.weight" not in pc.clamps
    q = pc.clamps["v.blk.1.attn_q.weight"]
    assert q[0] < 0 < q[1] and q[2] < 0 < q[3] and len(set(q)) == 4
    f = tower.file.tensors
    assert q == tuple(float(np.asarray(f[f"v.blk.1.attn_q.{s}"].raw()).view(np.float32).reshape(-1)[0])
                      for s in ("input_min", "input_max", "output_min", "output_max"))
    assert (gemma4v.BEGIN, gemma4v.END) == ("<|image>", "<image|>")
    assert tower.bidirectional is REF["non_causal"] is True and REF["mrope"] is False


def test_causality_by_the_text_models_width(tower, monkeypatch):
    """mtmd_decode_use_non_causal for gemma4v: causal where the text model is 1536 (E2B) or 2560 (E4B) wide,
    both ways otherwise; the tower's rule reads its projection's width. Mutations: the rule as Gemma 3's (always
    both ways), or E4B's width left out, each fail it."""
    assert [gemma4v.bidirectional(e) for e in (1536, 2560, 32, 2048, 5376)] == [False, False, True, True, True]
    monkeypatch.setattr(tower, "n_embd_out", 1536)
    assert tower.bidirectional is False
    monkeypatch.setattr(tower, "n_embd_out", 2560)
    assert tower.bidirectional is False


def test_clamp_bounds_default_to_float_max():
    """A linear with only some bounds in the file gets +-FLT_MAX for the rest (clip.cpp's get_scalar defaults);
    one with none is not clamped. Mutation: a missing bound as 0 fails it."""
    from hearthlm.core.weights import QWeight
    one = np.float32([-2.0])
    w = {"a.weight": None, "a.input_min": QWeight("a.input_min", 0, (1,), one.view(np.uint8)), "b.weight": None}
    big = float(np.finfo(np.float32).max)
    assert gemma4v._clamps(w, "x") == {"a.weight": (-2.0, big, -big, big)}


def test_rope_2d_turns_each_half_by_its_axis():
    """The tower's 2D RoPE: a head's first half turned in NeoX pairs (i, i + d/4) by the patch's column, its
    second half by its row, frequencies base^(-4i/d) in each half (Gemma4VisionRotaryEmbedding, ggml_rope_ext
    twice). Mutation: positions (row, column) fails it."""
    n, h, d = 6, 2, 16
    x = np.random.default_rng(0).standard_normal((n, h, d)).astype(np.float32)
    col, row = np.arange(n) % 3, np.arange(n) // 3
    pos = np.broadcast_to(np.stack([col, row], 1)[:, None, :], (n, h, 2)).reshape(-1).astype(np.int32)
    g = Graph()
    xi, pi = g.input("x", (n, h, d), np.float32), g.input("p", (n * h * 2,))
    g.outputs.append(gemma4v._rope_2d(g, xi, pi, "q", 0))
    be, vals, feed = get_backend("reference"), {}, {"x": x, "p": pos}
    for node in g.nodes:  # the reference's kernels in order
        vals[id(node)] = feed[node.name] if node.op is Op.INPUT else be.bind(node)(*[vals[id(s)] for s in node.srcs])
    got = np.asarray(vals[id(g.outputs[0])])
    want = x.astype(np.float64).copy()
    q = d // 4
    freq = gemma4v.ROPE_BASE ** (-np.arange(q) / q)
    for half, p in ((0, col), (1, row)):
        a = p[:, None, None] * freq  # (n, 1, q)
        lo, hi = x[..., half * 2 * q:half * 2 * q + q], x[..., half * 2 * q + q:(half + 1) * 2 * q]
        want[..., half * 2 * q:half * 2 * q + q] = lo * np.cos(a) - hi * np.sin(a)
        want[..., half * 2 * q + q:(half + 1) * 2 * q] = hi * np.cos(a) + lo * np.sin(a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_images_of_one_size_encode_together(tower):
    """Two images of one size in one graph give what each gives alone (positions, RoPE positions and seg per
    image). Mutation: the RoPE positions of the first image only (not tiled) fails it."""
    a = _prepared(tower, "gradient")[0]
    b = _prepared(tower, "noise")[0]
    alone = []
    for k, px in ((b"a", a), (b"b", b)):
        m = Media(0, 81, k, px)
        VisionEncoder(tower, Placement.single(get_backend("cpu"), tower.config.n_layer)).fill([m])
        alone.append(m.rows)
    both = [Media(0, 81, b"a", a), Media(0, 81, b"b", b)]
    enc = VisionEncoder(tower, Placement.single(get_backend("cpu"), tower.config.n_layer), slice_s=0.0)
    enc.fill(both)
    assert enc.images_encoded == 2
    for m, want in zip(both, alone):
        np.testing.assert_allclose(m.rows, want, rtol=1e-4, atol=1e-5)


def test_image_past_the_position_tables_refused(tower, monkeypatch):
    """An image whose resized grid is wider than the position tables is refused, naming both (llama.cpp would
    read past them). Mutation: no check fails it."""
    import dataclasses
    monkeypatch.setattr(tower, "pconfig", dataclasses.replace(tower.pconfig, n_pos=30))
    tower.prepare(load_image(rgb(REF["images"]["gradient"]["recipe"])))  # 27x27 patches: fits
    with pytest.raises(InvalidRequestError, match="33x21 patches .* hold 30 a side"):
        tower.prepare(load_image(rgb(REF["images"]["wide"]["recipe"])))


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_preprocessed_size_is_mtmds(tower, name):
    """The prepared image's row count is mtmd's image chunk's n_tokens (= n_pos). Mutation: the 70-row minimum
    as 64 fails the gradient (8x8)."""
    chunks = {im: c for p in REF["prompts"].values()
              for c, im in zip([c for c in p["chunks"] if c["type"] == "image"], p["images"])}
    _, n, _ = _prepared(tower, name)
    assert n == chunks[name]["n_tokens"] == chunks[name]["n_pos"]


# ---- the text model: image rows in Gemma 4 --------------------------------------------------

def test_full_layers_stay_causal_for_images():
    """A step with images: the sliding layers' masks read each token's horizon (an image's rows see the image's
    end), the full layers' do not (llama.cpp's LLAMA_NON_CAUSAL_TYPE_SWA_ONLY); both without images read none.
    Mutation: the full layers given the horizons too fails it."""
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime.batch import BatchShape
    m = load_model(MODEL)
    try:
        full = [il for il, swa in enumerate(m.config.swa_layers) if not swa]
        assert full == [1, 4, 6]
        for n_media, horizons in ((5, [il not in full for il in range(7)]), (0, [False] * 7)):
            g = m.build_graph(BatchShape(n_tokens=8, n_seqs=1, max_blocks=1, n_out=1, n_slots=16, block_size=16,
                                         n_media=n_media))
            masks = sorted((n.layer, len(n.srcs) == 2) for n in g.nodes if n.op is Op.KQ_MASK)
            assert [h for _, h in masks] == horizons, n_media
    finally:
        m.close()


def _images_of(case) -> list[np.ndarray]:
    return [rgb(REF["images"][k]["recipe"]) for k in case["images"]]


@pytest.fixture(scope="module", params=[(b, c) for b in ("cpu", "reference") for c in ("both_ways", "causal")],
                ids=lambda p: "-".join(p))
def vision_session(request):
    """(causal, session): the tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record, 64-token
    steps (an image of 81 rows is computed whole); one session per causality, as their K/V differ."""
    from hearthlm import SyncSession
    backend, kind = request.param
    s = SyncSession(str(MODEL), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield kind == "causal", s
    s.close()


def _as_e2b(mp: pytest.MonkeyPatch, causal: bool) -> None:
    """Make the 32-wide text model decode image rows as E2B's (causally) where `causal`."""
    if causal:
        mp.setattr(gemma4v, "CAUSAL_WIDTHS", (*gemma4v.CAUSAL_WIDTHS, REF["n_embd"]))


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks (BOS, text, <|image>, a placeholder per row, <image|>, text),
    each image of as many rows as its chunk, both ways unless causal. Mutation: BEGIN and END swapped fails it."""
    causal, ss = vision_session
    case, s = REF["prompts"][name], ss.session
    with pytest.MonkeyPatch.context() as mp:
        _as_e2b(mp, causal)
        ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case))
    want = [t for ch in case["chunks"] for t in (ch["tokens"] if ch["type"] == "text" else [None] * ch["n_tokens"])]
    assert [t if t >= 0 else None for t in ids] == want
    assert [m.n for m in media] == [ch["n_tokens"] for ch in case["chunks"] if ch["type"] == "image"]
    assert all(m.bidirectional is (not causal) for m in media)



@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (0.05 nats) on prompts with one image, two, an image between text,
    and 335 tokens of text after one, as libmtmd computes them: rows both ways in the sliding layers (this model),
    or causal (E2B/E4B; the record's "causal" steps). Mutations: the full layers attending both ways too, the
    rows both ways for E2B's width, image rows' per-layer inputs from token 1's row (not 0's), image rows scaled
    by sqrt(n_embd) as tokens are, or the per-layer projection of the unspliced embeddings, each fail it."""
    causal, ss = vision_session
    case = REF["prompts"][name]
    want = case["causal"] if causal else case
    with pytest.MonkeyPatch.context() as mp:
        _as_e2b(mp, causal)
        c = ss.generate(case["text"], images=_images_of(case), max_tokens=len(want["greedy_ids"]), temperature=0,
                        top_logprobs=5)
        mp.setattr(golden, "TOP1_LOGPROB_TOL", LOGPROB_TOL)
        why = golden.compare_top5(want, c, LOGPROB_TOL)
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    assert why is None, why


@pytest.mark.parametrize("causal", [False, True], ids=["both_ways", "causal"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_text_side_with_llama_cpps_rows(backend, causal):
    """llama.cpp's own image rows (in a fresh session's encoder cache under the images' keys) give its log-probs
    within 0.01 nats (measured: 0.003 at most) at every step of every prompt: the text side (rows unscaled, per-layer inputs of token 0 and
    of the spliced rows, sliding-only horizons) is llama.cpp's. Mutations: as test_prompts_match_llama_cpp's."""
    from hearthlm import SyncSession
    failures = []
    with SyncSession(str(MODEL), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64) as ss, \
            pytest.MonkeyPatch.context() as mp:
        _as_e2b(mp, causal)
        s = ss.session
        enc = s.engine.runner.vision
        for k, im in REF["images"].items():
            enc.cache.put(_prepared(s.vision, k)[2], np.asarray(im["rows"], np.float32))
        for name, case in REF["prompts"].items():
            want = case["causal"] if causal else case
            c = ss.generate(case["text"], images=_images_of(case), max_tokens=len(want["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            why = golden.compare_top5(want, c, 0.01)
            if why:
                failures.append(f"{name}: {why}")
        assert enc.images_encoded == 0 and enc.cache.misses == 0
    assert not failures, "\n".join(failures)
