"""Image input (#39) on the tiled families: SmolVLM (projector idefics3, a llama text model) and LFM2-VL (projector
lfm2, an lfm2 text model), tests/parity/hf specs "smolvlm-vision" and "lfm2-vision" converted by llama.cpp's
convert_hf_to_gguf.py (text model and --mmproj), against llama.cpp's libmtmd (tests/data/vision_parity_smolvlm.json
and _lfm2.json, each tile's and overview's rows in vision_rows_<family>.npz, recorded by
tests/parity/record_vision.py): an image is tiles plus an overview, each its own image chunk between marker
tokens; the rows of each, mtmd_tokenize's chunks and the prompts' greedy steps and log-probs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.vision import idefics3, lfm2
from hearthlm.model_zoo.vision.clip import Piece, Slice, load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.model_zoo.vision.merge import merge_order
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402  (tests/golden.py: the parity criterion)
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
CONVERTED = DATA / "converted"
FAMILIES = {  # name -> (text model, mmproj, llama.cpp's record, its rows)
    "smolvlm": (CONVERTED / "smolvlm-vision.gguf", CONVERTED / "smolvlm-vision.mmproj.gguf",
                json.loads((DATA / "vision_parity_smolvlm.json").read_text()), np.load(DATA / "vision_rows_smolvlm.npz")),
    "lfm2": (CONVERTED / "lfm2-vision.gguf", CONVERTED / "lfm2-vision.mmproj.gguf",
             json.loads((DATA / "vision_parity_lfm2.json").read_text()), np.load(DATA / "vision_rows_lfm2.npz")),
}
# Image rows: max |ours - llama.cpp's| over the rows' largest magnitude. What is left is ggml-cpu's GELU reading a
# float16 table (emulated, SmolVLM's rows agree within 1e-5, LFM2-VL's within 3e-4: its 768-pixel patches and
# 1024-patch tiles cross more float16 rounding edges); measured 1.7e-4 and 5.2e-4.
ROWS_TOL = {"smolvlm": 3e-4, "lfm2": 1e-3}
LOGPROB_TOL = 0.02  # nats, top-5 of every step (measured: 0.0006 and 0.0021)
IMAGE_CASES = [(f, i) for f, (_, _, ref, _) in FAMILIES.items() for i in sorted(ref["images"])]
PROMPT_CASES = [(f, p) for f, (_, _, ref, _) in FAMILIES.items() for p in sorted(ref["prompts"])]


def _backends() -> list[str]:
    """reference and cpu, and cuda where HEARTHLM_TEST_BACKENDS names it."""
    env = [n.strip() for n in os.environ.get("HEARTHLM_TEST_BACKENDS", "").split(",") if n.strip()]
    return env or ["cpu", "reference"]


@pytest.fixture(scope="module")
def towers():
    vms = {f: load_mmproj(mmproj, n_embd_text=ref["n_embd"]) for f, (_, mmproj, ref, _) in FAMILIES.items()}
    yield vms
    for vm in vms.values():
        vm.close()


def _slices(vm, fam: str, name: str) -> list[Slice]:
    return [p for p in vm.layout(load_image(rgb(FAMILIES[fam][2]["images"][name]["recipe"]))) if isinstance(p, Slice)]


# ---- the towers ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fam,name", IMAGE_CASES)
def test_tower_rows_match_llama_cpp(towers, backend, fam, name):
    """Each tile's and the overview's rows, in mtmd's order (tiles row by row, then the overview), encoded in one
    call (the slices of one size in one graph), are llama.cpp's: SmolVLM's 2x2, 2x1 and 1x2 tiles of 32 plus the
    overview; LFM2-VL's 2x1 tiles of 512 (32x32 patches: the 16x16 table resized up) plus its 704x352 thumbnail,
    a small image (20x14 patches: the table up across, down along) and one at the table's own size. Mutations:
    the shuffle's parts dx before dy, the overview laid out first, the patch embedding in full precision
    (SmolVLM's), the positions resized without antialiasing (plain bilinear) or not resized, the LayerNorm without
    its bias, each fail it."""
    _, _, ref, rows = FAMILIES[fam]
    vm = towers[fam]
    sl = _slices(vm, fam, name)
    ms = [Media(0, s.n, s.key, s.pixels) for s in sl]
    VisionEncoder(vm, Placement.single(get_backend(backend), vm.config.n_layer), slice_s=0.0).fill(ms)
    assert [list(m.rows.shape) for m in ms] == ref["images"][name]["chunk_shapes"]
    for k, m in enumerate(ms):
        want = rows[f"{name}/{k}"]
        err = np.abs(m.rows - want).max() / np.abs(want).max()
        assert err < ROWS_TOL[fam], f"{backend} {fam} {name} chunk {k}: {err:.2e} off llama.cpp's"


def test_projectors_read_the_files(towers):
    """idefics3: shuffle by 2, the longest edge 64 (clip.vision.preproc_image_size); lfm2: unshuffle by 2, clip.cpp's
    LFM2 limits of 64 to 256 rows, the 16x16 table; both causal as libmtmd records (non_causal false, no M-RoPE).
    Mutations: lfm2's limits as Qwen's (8, 4096), or the preproc size not read (0), each fail it."""
    s, lf = towers["smolvlm"], towers["lfm2"]
    assert s.proj is idefics3 and lf.proj is lfm2
    assert (s.pconfig.n_merge, s.pconfig.longest_edge) == (2, 64)
    area = (lf.config.patch_size * 2) ** 2
    assert (lf.pconfig.n_merge, lf.pconfig.min_pixels, lf.pconfig.max_pixels) == (2, 64 * area, 256 * area)
    assert lf.pconfig.pos_table.shape == (16, 16, 32)
    for fam, vm in towers.items():
        ref = FAMILIES[fam][2]
        assert vm.bidirectional is ref["non_causal"] is False and ref["mrope"] is False


def test_pixel_shuffle_is_clip_cpps():
    """merge_order against clip.cpp's build_patch_merge_permute done step by step in numpy (ggml's reshapes and
    permutes; ne[0] fastest): a 4x6 grid by 2 and a 6x6 by 3; a 3x5 grid pads to whole cells with zero patches
    (ggml_pad at the right and bottom). Mutations: the parts dx before dy, or the padding's mask all ones, each
    fail it."""
    def ggml_merge(a: np.ndarray, s: int) -> np.ndarray:  # a: (h, w, e) patches, as ggml's (e, w, h)
        h, w, e = a.shape
        ph, pw = -(-h // s) * s, -(-w // s) * s
        a = np.pad(a, ((0, ph - h), (0, pw - w), (0, 0)))
        b = a.reshape(ph, pw // s, s * e)                    # reshape_3d(n_embd * s, w / s, h)
        c = b.transpose(1, 0, 2)                             # permute(0, 2, 1, 3): (w / s, h, s e)
        d = c.reshape(pw // s, ph // s, s * s * e)           # cont_3d(n_embd * s * s, h / s, w / s)
        return d.transpose(1, 0, 2).reshape(-1, s * s * e)   # permute(0, 2, 1, 3), cont_2d
    rng = np.random.default_rng(0)
    for h, w, s in ((4, 6, 2), (6, 6, 3), (3, 5, 2)):
        a = rng.standard_normal((h, w, 3)).astype(np.float32)
        order, keep = merge_order(h, w, s)
        got = a.reshape(h * w, 3)[order] * (1 if keep is None else keep)
        np.testing.assert_array_equal(got.reshape(-1, s * s * 3), ggml_merge(a, s))
        assert (keep is None) == (h % s == 0 and w % s == 0)


@pytest.mark.parametrize("backend", _backends())
def test_merge_graph_pads_with_zero_patches(backend):
    """build_merge in a graph: two images of a 3x5 grid by 2 (cells padded at the right and bottom) give each
    image's merged rows, the padding zero. Mutation: the merge_keep mask not applied fails it."""
    from hearthlm.core.graph import F32, Graph
    from hearthlm.model_zoo.vision.merge import build_merge, merge_inputs
    from hearthlm.runtime.dispatch import execute
    from hearthlm.runtime.graph_cache import GraphCache

    def build(shape):
        g = Graph()
        x = g.input("x", (2 * 15, 4), F32)
        g.outputs.append(build_merge(g, g.add(x, x, "twice"), n_images=2, ny=3, nx=5, s=2))
        return g
    x = np.random.default_rng(1).standard_normal((30, 4)).astype(np.float32) + 3  # no zeros of its own
    cg = GraphCache(build, Placement.single(get_backend(backend), 1)).get(("merge", 2, 3, 5))
    (out,) = execute(cg, {"x": x, **merge_inputs(2, 3, 5, 2)}, lambda node: None)
    out = np.asarray(out)
    assert out.shape == (2 * 2 * 3, 16)
    for b in range(2):
        order, keep = merge_order(3, 5, 2)
        want = (2 * x[b * 15:(b + 1) * 15])[order] * keep
        np.testing.assert_allclose(out[b * 6:(b + 1) * 6], want.reshape(6, 16), rtol=1e-6)
    per = out.reshape(2, 2, 3, 4, 4)  # (image, cell row, cell column, part dy * 2 + dx, E)
    assert (per[:, 1, :, 2:] == 0).all() and (per[:, :, 2, 1::2] == 0).all()  # dy past the bottom, dx past the right
    assert (per[:, 0, :2] != 0).all()


def test_resized_positions_are_ggmls():
    """lfm2.resize_positions gives ggml_interpolate's output (bilinear, antialiased; libggml's own, recorded by
    tests/parity/record_interpolate.py) bit for bit, grids up, down and mixed. Mutations: plain bilinear, the
    pixel offset 0 (corners aligned), or the weighted sum rounded after each product (no fused multiply-add),
    each fail it."""
    rec = np.load(DATA / "ggml_interpolate.npz")
    table = rec["table"]
    for k in rec.files:
        if k != "table":
            ny, nx = map(int, k.split("x"))
            np.testing.assert_array_equal(lfm2.resize_positions(table, ny, nx), rec[k], err_msg=k)
    assert np.array_equal(lfm2.resize_positions(table, 16, 16), table.reshape(256, 4))


def test_resized_tables_kept_are_bounded(towers):
    """A tower keeps the last RESIZED_KEPT grids' tables (thumbnails' grids vary with their images), the same
    values again. Mutation: never dropping one fails it."""
    pc = towers["lfm2"].pconfig
    first = pc.positions(4, 6).copy()
    for k in range(lfm2.RESIZED_KEPT + 4):
        pc.positions(2 + k, 3)
    assert len(pc._resized) == lfm2.RESIZED_KEPT and (4, 6) not in pc._resized
    assert np.array_equal(pc.positions(4, 6), first)


# ---- layouts and prompts -------------------------------------------------------------------

def test_layouts():
    """The pieces of an image in order. SmolVLM's 2x2: each tile after its <fake_token_around_image><row_r_col_c>,
    "\\n" between rows only, then "\\n\\n", <fake_token_around_image>, <global-img>, the overview and
    <fake_token_around_image>; LFM2-VL's big image: <|image_start|>, each tile after <|img_row_r_col_c|> (no row
    ends), <|img_thumbnail|>, the thumbnail, <|image_end|>; a small one: the image between the markers. Each
    slice's key its own. Mutations: a "\\n" after the last row, or the thumbnail before the tiles, each fail it."""
    def kinds(parts):
        return [p if isinstance(p, str) else f"P{p.text!r}" if isinstance(p, Piece) else f"S{p.pixels.shape[1:]}"
                for p in parts]
    vm = load_mmproj(FAMILIES["smolvlm"][1])
    try:
        parts = vm.layout(load_image(rgb(FAMILIES["smolvlm"][2]["images"]["square"]["recipe"])))
    finally:
        vm.close()
    t = "S(32, 32)"
    assert kinds(parts) == ["<fake_token_around_image><row_1_col_1>", t, "<fake_token_around_image><row_1_col_2>", t,
                            "P'\\n'", "<fake_token_around_image><row_2_col_1>", t,
                            "<fake_token_around_image><row_2_col_2>", t, "P'\\n\\n'", "P'<fake_token_around_image>'",
                            "P'<global-img>'", t, "P'<fake_token_around_image>'"]
    assert len({p.key for p in parts if isinstance(p, Slice)}) == 5
    vm = load_mmproj(FAMILIES["lfm2"][1])
    try:
        recipes = FAMILIES["lfm2"][2]["images"]
        big = vm.layout(load_image(rgb(recipes["big"]["recipe"])))
        small = vm.layout(load_image(rgb(recipes["small"]["recipe"])))
    finally:
        vm.close()
    assert kinds(big) == ["<|image_start|>", "<|img_row_1_col_1|>", "S(512, 512)", "<|img_row_1_col_2|>", "S(512, 512)",
                          "P'<|img_thumbnail|>'", "S(352, 704)", "<|image_end|>"]
    assert kinds(small) == ["<|image_start|>", "S(224, 320)", "<|image_end|>"]


@pytest.fixture(scope="module", params=[(f, b) for f in FAMILIES for b in _backends()], ids=lambda p: "-".join(p))
def vision_session(request):
    """(family, session): the tiny model with its mmproj found beside it, llama.cpp's context size and F32 K/V;
    64-token steps, so that a tiled image's chunks span several."""
    from hearthlm import SyncSession
    fam, backend = request.param
    ref = FAMILIES[fam][2]
    s = SyncSession(str(FAMILIES[fam][0]), backend=backend, n_ctx=ref["settings"]["n_ctx"], kv_cache_type="f32",
                    max_batch_tokens=64)
    yield fam, s
    s.close()


def _images_of(fam: str, case) -> list[np.ndarray]:
    return [rgb(FAMILIES[fam][2]["images"][k]["recipe"]) for k in case["images"]]


@pytest.mark.parametrize("name", sorted(FAMILIES["smolvlm"][2]["prompts"]))
def test_prompt_tokens_match_mtmd(vision_session, name):
    """The prompt's ids are mtmd_tokenize's chunks: text tokens (the markers among them: looked up by their text,
    or tokenized with special tokens parsed) and one placeholder per row of each image chunk, a Media per chunk
    at its place. Mutations: the row markers 0-based, their special tokens not parsed, <global-img> left out, or
    <|image_end|> after a tiled image left out, each fail it."""
    fam, ss = vision_session
    case, s = FAMILIES[fam][2]["prompts"][name], ss.session
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(fam, case))
    want, spans, at = [], [], 0
    for ch in case["chunks"]:
        n = len(ch["tokens"]) if ch["type"] == "text" else ch["n_tokens"]
        want += ch["tokens"] if ch["type"] == "text" else [None] * n
        if ch["type"] == "image":
            spans.append((at, n))
        at += n
    assert [t if t >= 0 else None for t in ids] == want
    assert [(m.start, m.n) for m in media] == spans


@pytest.mark.parametrize("name", sorted(FAMILIES["smolvlm"][2]["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (LOGPROB_TOL) as libmtmd computes them, on one image, two, an
    image between text and 300+ tokens of text after one (SmolVLM's 2x2, 2x1 and 1x2 tiles; LFM2-VL's tiled image
    alone and after a small one, the small and the square ones). Mutations: the image rows attending both ways
    (either family), or the tiles taken column by column, each fail it."""
    fam, ss = vision_session
    case = FAMILIES[fam][2]["prompts"][name]
    c = ss.generate(case["text"], images=_images_of(fam, case), max_tokens=len(case["greedy_ids"]), temperature=0,
                    top_logprobs=5)
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(golden, "TOP1_LOGPROB_TOL", LOGPROB_TOL)
        why = golden.compare_top5(case, c, LOGPROB_TOL)
    assert why is None, why


@pytest.mark.parametrize("fam", FAMILIES)
def test_text_side_with_llama_cpps_rows(fam):
    """llama.cpp's own rows for each chunk (in a fresh session's encoder cache under the slices' keys: nothing
    encoded here) give its log-probs within 0.01 nats at every step of every prompt: the layout and the text
    side are llama.cpp's. Mutations: a slice's key the image's (every tile then reads the first one's rows), or
    the chunks after an image's first placed a token late, each fail it."""

    from hearthlm import SyncSession
    model, _, ref, rows = FAMILIES[fam]
    with SyncSession(str(model), backend="cpu", n_ctx=ref["settings"]["n_ctx"], kv_cache_type="f32",
                     max_batch_tokens=64) as ss:
        s = ss.session
        enc = s.engine.runner.vision
        for name in ref["images"]:
            for k, sl in enumerate(_slices(s.vision, fam, name)):
                enc.cache.put(sl.key, rows[f"{name}/{k}"])
        failures = []
        for name, case in ref["prompts"].items():
            c = ss.generate(case["text"], images=_images_of(fam, case), max_tokens=len(case["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            why = golden.compare_top5(case, c, 0.01)
            if why:
                failures.append(f"{name}: {why}")
        assert enc.images_encoded == 0 and enc.cache.misses == 0
    assert not failures, "\n".join(failures)


def test_an_images_slices_encode_together(towers):
    """An image's slices of one size go through the tower in one graph and give what each gives alone (SmolVLM's
    four tiles and overview: one job of five; LFM2-VL's two tiles together, the thumbnail in its own). Mutation:
    the merge order not offset past the first image of a batch fails it."""
    for fam, name, batches in (("smolvlm", "square", [5]), ("lfm2", "big", [2, 1])):
        vm = towers[fam]
        sl = _slices(vm, fam, name)
        enc = VisionEncoder(vm, Placement.single(get_backend("cpu"), vm.config.n_layer), slice_s=0.0)
        together = [Media(0, s.n, s.key, s.pixels) for s in sl]
        enc.want(together)
        assert [len(j.media) for j in enc._jobs] == batches
        enc.fill(together)
        for s, m in zip(sl, together):
            alone = Media(0, s.n, s.key + b"alone", s.pixels)
            VisionEncoder(vm, Placement.single(get_backend("cpu"), vm.config.n_layer)).fill([alone])
            np.testing.assert_allclose(m.rows, alone.rows, rtol=1e-4, atol=1e-5, err_msg=f"{fam} {name}")


def test_an_mmproj_of_another_family_is_refused():
    """SmolVLM's mmproj beside LFM2's text model (both 64 wide) is refused naming the "\\n\\n" its layout looks
    up; LFM2-VL's beside SmolVLM's names <|image_start|>. Mutation: check_text_model skipping the layout's
    tokens fails the first."""
    from hearthlm import SyncSession
    with pytest.raises(ModelLoadError, match=r"lays out images with the token '\\n\\n'"):
        SyncSession(str(FAMILIES["lfm2"][0]), mmproj=FAMILIES["smolvlm"][1], n_ctx=256)
    with pytest.raises(ModelLoadError, match=r"marks images with '<\|image_start\|>'"):
        SyncSession(str(FAMILIES["smolvlm"][0]), mmproj=FAMILIES["lfm2"][1], n_ctx=256)


def test_piece_id_is_mtmds_lookup():
    """Tokenizer.piece_id finds the lowest id whose text is exactly the given one: "\\n\\n" (a byte-level BPE
    token), "\\n", a control token; None where none renders so. Mutation: looking the raw entry up only (no
    byte-level spelling) fails "\\n\\n"."""
    from hearthlm.model_zoo.model import load_model
    m = load_model(FAMILIES["smolvlm"][0])
    try:
        tok = m.tokenizer
        for text in ("\n\n", "\n", "<global-img>", " hearth"):
            i = tok.piece_id(text)
            assert i is not None and tok.token_bytes(i, special=True) == text.encode(), text
            assert all(tok.token_bytes(j, special=True) != text.encode() for j in range(i)), text
        assert tok.piece_id("<|img_thumbnail|>") is None and tok.piece_id("\n\n\n\n\n") is None
    finally:
        m.close()
