"""Image input (#39) on the tiny Qwen vision-language models (tests/parity/hf specs "qwen35-vision",
"qwen3vl-vision" and "qwen3vlmoe-vision", converted by llama.cpp's convert_hf_to_gguf.py, text model and --mmproj:
qwen3vl_merger projectors, Qwen3-VL's with deepstack layers, its MoE's text model with experts), against llama.cpp's
libmtmd (tests/data/vision_parity_qwen35.json, _qwen3vl.json and _qwen3vlmoe.json, recorded by
tests/parity/record_vision.py): the tower's rows, mtmd_tokenize's chunks and its M-RoPE positions, and the prompts'
greedy steps and log-probs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.model_zoo.vision import qwen3vl
from hearthlm.model_zoo.vision.clip import load_mmproj
from hearthlm.model_zoo.vision.image import load_image
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media, grid_positions, rope_positions
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
import golden  # noqa: E402  (tests/golden.py: the parity criterion)
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
FAMILIES = {  # name -> (text model, mmproj, llama.cpp's record)
    "qwen35": (DATA / "converted" / "qwen35-vision.gguf", DATA / "converted" / "qwen35-vision.mmproj.gguf",
               json.loads((DATA / "vision_parity_qwen35.json").read_text())),
    "qwen3vl": (DATA / "converted" / "qwen3vl-vision.gguf", DATA / "converted" / "qwen3vl-vision.mmproj.gguf",
                json.loads((DATA / "vision_parity_qwen3vl.json").read_text())),
    "qwen3vlmoe": (DATA / "converted" / "qwen3vlmoe-vision.gguf", DATA / "converted" / "qwen3vlmoe-vision.mmproj.gguf",
                   json.loads((DATA / "vision_parity_qwen3vlmoe.json").read_text())),
}
MODEL, MMPROJ, REF = FAMILIES["qwen35"]
ROWS_TOL = 1e-3  # image rows: max |ours - llama.cpp's| over the rows' largest magnitude
# Log-probs of the top-5 (nats). ggml-cpu's GELU reads a float16 table, so llama.cpp's rows differ from ours by
# ~4e-4 of their largest (with that table emulated in the tower: 2e-5, and every prompt within 0.004 nats); the
# tiny random Qwen3.5 turns it into 0.08 nats on two_images' first step. test_text_side_with_llama_cpps_rows
# holds the text side to 0.01 on llama.cpp's own rows.
LOGPROB_TOL = {("qwen35", "two_images"): 0.1}
CASES = [(f, p) for f, (_, _, ref) in FAMILIES.items() for p in sorted(ref["prompts"])]
IMAGE_CASES = [(f, i) for f, (_, _, ref) in FAMILIES.items() for i in sorted(ref["images"])]


@pytest.fixture(scope="module")
def towers():
    vms = {f: load_mmproj(mmproj, n_embd_text=ref["n_embd"]) for f, (_, mmproj, ref) in FAMILIES.items()}
    yield vms
    for vm in vms.values():
        vm.close()


@pytest.fixture(scope="module")
def tower(towers):
    return towers["qwen35"]


def _prepared(vm, name: str, ref=REF):
    return vm.prepare(load_image(rgb(ref["images"][name]["recipe"])))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("fam,name", IMAGE_CASES)
def test_tower_rows_match_llama_cpp(towers, backend, fam, name):
    """Each image through the tower gives llama.cpp's rows: the gradient (64x64: 16x16 patches, the 8x8 position
    table resized), the noise (32x32: the table at its own size) and the wide one (44x26 resized to 48x24: a
    12x6 grid); Qwen3-VL's rows with its two deepstack layers' columns after the merger's, the tower run in
    turns of a block or a kernel (the columns carried between turns). Mutations: patches in row-major order (no 2x2 blocks), the
    table resized without aligned corners, the RoPE turning every pair by the row, the second temporal kernel
    left out (qwen3vlmoe's rows too), or a deepstack column taken before its layer's FFN, each fail it."""
    ref, vm = FAMILIES[fam][2], towers[fam]
    img = ref["images"][name]
    pixels, n, key = _prepared(vm, name, ref)
    enc = VisionEncoder(vm, Placement.single(get_backend(backend), vm.config.n_layer), slice_s=0.0)
    m = Media(0, n, key, pixels)
    enc.want([m])
    while enc.pending:  # turns of one block of rows or one small kernel: the tower stopped everywhere
        enc.advance(1e-12)
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == tuple(img["shape"])
    e = FAMILIES[fam][2]["n_embd"] // (1 + len(vm.pconfig.deepstack))
    for k in range(want.shape[1] // e):  # the merger's columns, then each deepstack layer's
        err = np.abs(m.rows[:, k * e:(k + 1) * e] - want[:, k * e:(k + 1) * e]).max() / np.abs(want).max()
        assert err < ROWS_TOL, f"{backend} {fam} {name} columns {k}: {err:.2e} off llama.cpp's"


def test_projector_reads_the_file(tower):
    """qwen3vl_merger: merge 2 (spatial_merge_size), clip.cpp's Qwen-VL limits of 8 to 4096 rows, the markers
    and causal rows libmtmd uses (its non_causal and mrope flags as recorded). Mutations: a minimum of 4 rows,
    or BIDIRECTIONAL set, each fail it."""
    c, pc = tower.config, tower.pconfig
    assert c.projector == "qwen3vl_merger" and tower.proj is qwen3vl
    area = (c.patch_size * pc.n_merge) ** 2
    assert (pc.n_merge, pc.min_pixels, pc.max_pixels) == (2, 8 * area, 4096 * area)
    assert pc.pos_table.shape == (8, 8, c.n_embd) and pc.deepstack == ()
    assert (qwen3vl.BEGIN, qwen3vl.END) == ("<|vision_start|>", "<|vision_end|>")
    assert tower.bidirectional is REF["non_causal"] is False and REF["mrope"] is True


@pytest.mark.parametrize("name", sorted(REF["images"]))
def test_preprocessed_grid_is_mtmds(tower, name):
    """The prepared image's rows across and down, and their count, are mtmd's image chunk's (nx, ny, n_tokens).
    Mutation: the grid as (ny, nx) fails the wide image."""
    chunks = {im: c for p in REF["prompts"].values()
              for c, im in zip([c for c in p["chunks"] if c["type"] == "image"], p["images"])}
    chunk = chunks[name]
    pixels, n, _ = _prepared(tower, name)
    assert (*tower.grid(pixels), n) == (chunk["nx"], chunk["ny"], chunk["n_tokens"])


def test_resized_positions_interpolate_with_corners_aligned():
    """The table resized as ggml_interpolate's bilinear with aligned corners: the corners kept, a 2x2 table to
    3x3 gives the midpoints; the table at its own size unchanged. Mutation: pixel-centre sampling fails it."""
    t = np.arange(2 * 2 * 1, dtype=np.float32).reshape(2, 2, 1)  # [[0, 1], [2, 3]]
    out = qwen3vl.resize_positions(t, 3, 3).reshape(3, 3)
    np.testing.assert_allclose(out, [[0, 0.5, 1], [1, 1.5, 2], [2, 2.5, 3]])
    assert np.array_equal(qwen3vl.resize_positions(t, 2, 2), t.reshape(4, 1))
    order = qwen3vl.merge_order(2, 4)  # 2 rows of 4 patches: two 2x2 blocks
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


# ---- prompts: tokens and M-RoPE positions as mtmd's ---------------------------------------

def _images_of(case, fam: str = "qwen35") -> list[np.ndarray]:
    return [rgb(FAMILIES[fam][2]["images"][k]["recipe"]) for k in case["images"]]


@pytest.fixture(scope="module", params=[(f, b) for f in FAMILIES for b in ("cpu", "reference")],
                ids=lambda p: "-".join(p))
def vision_session(request):
    """(family, session): the tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record;
    64-token steps, so that the gradient's 64 rows span two chunks and the long prompt's text several."""
    from hearthlm import SyncSession
    fam, backend = request.param
    s = SyncSession(str(FAMILIES[fam][0]), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield fam, s
    s.close()


def test_families_record_the_same_prompts():
    assert all(sorted(ref["prompts"]) == sorted(REF["prompts"]) for _, _, ref in FAMILIES.values())


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_and_positions_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks (<|vision_start|>, a placeholder per row, <|vision_end|>),
    and each token's M-RoPE position components as llama.cpp decodes them: text at (p, p, p, 0), an image's
    rows at (p0, p0 + y, p0 + x, 0), the text after it at p0 + max(nx, ny) (mtmd's n_pos), the same computed
    chunk by chunk; a text model without M-RoPE takes none. Mutations: an image advancing the position by its
    row count, or its grid transposed, each fail it."""
    fam, ss = vision_session
    case, s = FAMILIES[fam][2]["prompts"][name], ss.session
    assert s.model.n_pos == 4
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case, fam))
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
    assert np.array_equal(np.concatenate([rope_positions(media, a, min(a + 13, len(ids)))
                                          for a in range(0, len(ids), 13)]), got)


def test_grid_positions():
    """Row-major rows at (0, y, x); the image takes max(nx, ny) positions. Mutation: (x, y) fails it."""
    pos, n_pos = grid_positions(3, 2)
    assert pos.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 1, 2]] and n_pos == 3


def test_only_mrope_models_take_positions():
    """The decoder graph has a "rope_pos" input only where the model's RoPE has components (qwen35 here,
    not gemma3). Mutation: build_inputs adding it for every model fails it."""
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime.batch import one_token
    for path, n_pos in ((MODEL, 4), (FAMILIES["qwen3vl"][0], 4), (FAMILIES["qwen3vlmoe"][0], 4),
                        (DATA / "converted" / "gemma3-vision.gguf", 1)):
        m = load_model(path)
        try:
            g = m.build_graph(one_token(n_state=2 if any(m.state_dims) else 0))
            assert m.n_pos == n_pos and ("rope_pos" in g.inputs) == (n_pos > 1)
            if n_pos > 1:
                assert g.inputs["rope_pos"].shape == (1, 4)
        finally:
            m.close()



@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (0.05 nats; see LOGPROB_TOL) on prompts with one image, two, an
    image between text, and 306 tokens of text after one, as libmtmd computes them. Mutations: the text model's
    RoPE by sequence index (no M-RoPE positions), the image rows attending both ways, (qwen3vl) deepstack
    slice i + 1 added to layer i + 1, or (qwen3vlmoe) its M-RoPE sections in runs (MROPE = "mrope") or the chosen
    experts' weights not renormalized (norm_w=False in qwen3moe.moe_ffn), each fail it."""
    fam, ss = vision_session
    case = FAMILIES[fam][2]["prompts"][name]
    c = ss.generate(case["text"], images=_images_of(case, fam), max_tokens=len(case["greedy_ids"]), temperature=0,
                    top_logprobs=5)
    assert c.prompt_tokens == sum(ch.get("n_tokens") or len(ch["tokens"]) for ch in case["chunks"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(golden, "TOP1_LOGPROB_TOL", 0.05)
        why = golden.compare_top5(case, c, LOGPROB_TOL.get((fam, name), 0.05))
    assert why is None, why


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_text_side_with_llama_cpps_rows(backend, fam):
    """llama.cpp's own image rows (in a fresh session's encoder cache under the images' keys: no prefix
    computed from ours) give its log-probs within 0.01 nats at every step of every prompt: the text side
    (positions, masks, Qwen3.5's recurrent layers over image rows, Qwen3-VL's deepstack) is llama.cpp's.
    Mutations: text after an image not shifted by n_pos - n, the rows' h and w components swapped, the
    deepstack slices added to no layer, or qwen3vlmoe's M-RoPE sections in runs, each fail it."""
    from hearthlm import SyncSession
    model, _, ref = FAMILIES[fam]
    with SyncSession(str(model), backend=backend, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64) as ss:
        s = ss.session
        enc = s.engine.runner.vision
        for k, im in ref["images"].items():
            enc.cache.put(_prepared(s.vision, k, ref)[2], np.asarray(im["rows"], np.float32))
        failures = []
        for name, case in ref["prompts"].items():
            c = ss.generate(case["text"], images=_images_of(case, fam), max_tokens=len(case["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            why = golden.compare_top5(case, c, 0.01)
            if why:
                failures.append(f"{name}: {why}")
        assert enc.images_encoded == 0 and enc.cache.misses == 0
    assert not failures, "\n".join(failures)


def test_mrope_requests_need_positions():
    """An M-RoPE model's engine refuses an image without its rows' grid positions (it would place them as
    text), names it, and takes it with them. Mutation: check_media ignoring mrope fails it."""
    from hearthlm.core.errors import InvalidRequestError
    from hearthlm.runtime.request import Kind, Request, check_media
    from hearthlm.runtime.sampling import SamplingParams
    rows = np.zeros((6, 4), np.float32)
    req = Request(prompt=[1] + [-5] * 6 + [2], params=SamplingParams(), max_tokens=1, on_token=print,
                  on_finish=print, kind=Kind.GENERATE, media=[Media(1, 6, b"k", None, rows=rows)])
    check_media(req, True)  # a model without M-RoPE: positions as tokens
    with pytest.raises(InvalidRequestError, match="image at 1..7 has no grid positions"):
        check_media(req, True, mrope=True)
    req.media[0].positions, req.media[0].n_pos = grid_positions(3, 2)
    check_media(req, True, mrope=True)


@pytest.mark.parametrize("fam", ["qwen3vl", "qwen3vlmoe"])
def test_deepstack_graph(fam):
    """Qwen3-VL's decoder graph with images takes rows 3 x 64 wide and adds slices 1 and 2 to layers 0 and 1
    only; without images it reads no rows and adds nothing; the MoE's FFNs are top-2 experts in every layer.
    Mutations: deepstack=0 in models/qwen3vl.py or models/qwen3vlmoe.py, or qwen3vlmoe's ffn hook left out (the
    dense FFN: its tensors missing), each fail it."""
    from hearthlm.model_zoo.model import load_model
    from hearthlm.runtime.batch import BatchShape
    m = load_model(FAMILIES[fam][0])
    try:
        moe = sorted(n.layer for n in m.build_graph(BatchShape(n_tokens=8, n_seqs=1, max_blocks=1, n_out=1, n_slots=16,
                                                                block_size=16)).nodes if n.name == "ffn_moe_topk")
        assert moe == ([0, 1, 2, 3] if fam == "qwen3vlmoe" else [])
        assert m.n_embd_inp == 192 and m.config.n_deepstack == 2
        shape = BatchShape(n_tokens=8, n_seqs=1, max_blocks=1, n_out=1, n_slots=16, block_size=16, n_media=5)
        g = m.build_graph(shape)
        assert g.inputs["media_rows"].shape == (5, 192)
        adds = [n for n in g.nodes if n.name == "deepstack"]
        assert [(n.layer, n.params["start"], n.params["stop"]) for n in adds] == [(0, 64, 128), (1, 128, 192)]
        plain = m.build_graph(BatchShape(n_tokens=8, n_seqs=1, max_blocks=1, n_out=1, n_slots=16, block_size=16))
        assert "media_rows" not in plain.inputs and not any(n.name == "deepstack" for n in plain.nodes)
    finally:
        m.close()


@pytest.mark.parametrize("backend", ["cpu"])
def test_prefix_reuse_keeps_positions(backend):
    """The same prompt again reuses the KV blocks of its prefix (its image included: the placeholders carry the
    image) and computes the rest at the shifted M-RoPE positions: llama.cpp's log-probs again. Mutation:
    rope_positions ignoring the images before lo (a chunk past a cached image, or a decoding step, unshifted)
    fails it."""
    from hearthlm import SyncSession
    model, _, ref = FAMILIES["qwen3vl"]
    case = ref["prompts"]["two_images"]
    with SyncSession(str(model), backend=backend, n_ctx=512, kv_cache_type="f32") as ss:
        for run in range(2):
            c = ss.generate(case["text"], images=_images_of(case, "qwen3vl"), max_tokens=len(case["greedy_ids"]),
                            temperature=0, top_logprobs=5)
            assert golden.compare_top5(case, c, 0.05) is None, f"run {run}"
        assert ss.session.engine.stats()["prefix_cache_hit_tokens"] >= 80


def test_images_of_one_size_encode_together(towers):
    """Two images of one size in one graph give what each gives alone (each patch's merge index, position row
    and RoPE position offset to its image; attention within it), Qwen3-VL's columns too. Mutation: the merge
    order not offset past the first image fails it."""
    vm = towers["qwen3vl"]
    a = _prepared(vm, "gradient", FAMILIES["qwen3vl"][2])[0]
    b = vm.prepare(load_image(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)))[0]
    alone = []
    for k, px in ((b"a", a), (b"b", b)):
        m = Media(0, 64, k, px)
        VisionEncoder(vm, Placement.single(get_backend("cpu"), vm.config.n_layer)).fill([m])
        alone.append(m.rows)
    both = [Media(0, 64, b"a", a), Media(0, 64, b"b", b)]
    enc = VisionEncoder(vm, Placement.single(get_backend("cpu"), vm.config.n_layer), slice_s=0.0)
    enc.fill(both)
    assert enc.images_encoded == 2
    for m, want in zip(both, alone):
        np.testing.assert_allclose(m.rows, want, rtol=1e-4, atol=1e-5)
