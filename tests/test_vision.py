"""Image input (#39) on the tiny Gemma 3 vision model (tests/parity/hf: converted by llama.cpp's own
convert_hf_to_gguf.py, text model and --mmproj), against llama.cpp's libmtmd (tests/data/vision_parity.json,
recorded by tests/parity/record_vision.py): the tower's rows, and the loading, prompt and cache rules."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hearthlm.backends import get_backend
from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.chat_template import MEDIA_MARKER, chat_media
from hearthlm.model_zoo.vision.clip import find_mmproj, load_mmproj
from hearthlm.runtime.placement import Placement
from hearthlm.runtime.request import Media, chunk_past_media, placeholder_ids
from hearthlm.runtime.vision import VisionEncoder

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from record_vision import rgb  # noqa: E402  (the recorder's own image recipes)

DATA = Path(__file__).parent / "data"
MODEL, MMPROJ = DATA / "converted" / "gemma3-vision.gguf", DATA / "converted" / "gemma3-vision.mmproj.gguf"
REF = json.loads((DATA / "vision_parity.json").read_text())
ROWS_TOL = 1e-3  # image rows: max |ours - llama.cpp's| over the rows' largest magnitude


@pytest.fixture(scope="module")
def tower():
    vm = load_mmproj(MMPROJ, n_embd_text=REF["n_embd"])
    yield vm
    vm.close()


def _normalized(pixels: np.ndarray, vm) -> np.ndarray:
    """(H, W, 3) uint8 at the tower's size -> its input, (3, H, W) float32 by the file's mean/std."""
    x = pixels.astype(np.float32) / 255
    return ((x - np.float32(vm.config.mean)) / np.float32(vm.config.std)).transpose(2, 0, 1)


def _backends() -> list[str]:
    """reference and cpu, and cuda where HEARTHLM_TEST_BACKENDS names it (tests/gpu_check.sh's vision step)."""
    env = [n.strip() for n in os.environ.get("HEARTHLM_TEST_BACKENDS", "").split(",") if n.strip()]
    return env or ["cpu", "reference"]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("image", sorted(REF["images"]))
def test_tower_rows_match_llama_cpp(tower, backend, image):
    """Each image (64x64: the tower's own size; 32x32 scaled up; 40x24 fitted and letterboxed) through
    clip.cpp's preprocessing, SigLIP, the 4x4 pool, the soft-emb norm and the projection gives
    llama.cpp's rows (measured: 3.5e-4 of the largest at most; the rest is ggml's F16 GELU table and
    the F16 projection). Mutations: the pool averaging 2x2 cells, the norm without its weight, the
    projection not transposed, or stretching instead of letterboxing (the 40x24 image), each fail it."""
    from hearthlm.model_zoo.vision.image import load_image
    img = REF["images"][image]
    pixels, n, key = tower.prepare(load_image(rgb(img["recipe"])))
    enc = VisionEncoder(tower, Placement.single(get_backend(backend), tower.config.n_layer))
    m = Media(0, n, key, pixels)
    enc.fill([m])
    want = np.asarray(img["rows"], np.float32)
    assert m.rows.shape == want.shape == (16, REF["n_embd"])
    err = np.abs(m.rows - want).max() / np.abs(want).max()
    assert err < ROWS_TOL, f"{backend}: rows {err:.2e} off llama.cpp's"


def test_encoder_batches_caches_and_dedups(tower):
    """Two images in one graph give what each gives alone (attention stays within an image: the
    seg input); the same image again is a cache hit, encoded once. Mutation: a tower graph without
    `seg` (images attending to each other) fails the first assertion."""
    be = get_backend("cpu")
    enc = VisionEncoder(tower, Placement.single(be, tower.config.n_layer))
    a = _normalized(rgb(REF["images"]["gradient"]["recipe"]), tower)
    b = _normalized(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8), tower)
    alone = []
    for k, px in ((b"a", a), (b"b", b)):
        m = Media(0, 16, k, px)
        VisionEncoder(tower, Placement.single(be, tower.config.n_layer)).fill([m])
        alone.append(m.rows)
    both = [Media(0, 16, b"a", a), Media(0, 16, b"b", b), Media(40, 16, b"a", a)]
    enc.fill(both)
    assert enc.images_encoded == 2  # the repeated image once
    for m, want in zip(both, alone + alone[:1]):
        np.testing.assert_allclose(m.rows, want, rtol=1e-4, atol=1e-5)
    again = Media(0, 16, b"b", b)
    enc.fill([again])
    assert enc.images_encoded == 2 and enc.cache.hits >= 1
    assert enc.stats()["image_cache_bytes"] == 2 * 16 * REF["n_embd"] * 4


def test_encoder_cache_is_bounded():
    """The LRU drops the least recently used rows past its bytes. Mutation: no eviction fails it."""
    from hearthlm.runtime.vision import EncoderCache
    c = EncoderCache(max_bytes=3 * 64)
    rows = {k: np.zeros(16, np.float32) + i for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for k in (b"a", b"b", b"c"):
        c.put(k, rows[k])
    assert c.get(b"a") is not None  # a is now the most recent
    c.put(b"d", rows[b"d"])
    assert c.get(b"b") is None and c.get(b"a") is not None and c.nbytes <= c.max_bytes


# ---- loading -------------------------------------------------------------------------------

def test_mmproj_found_beside_the_model(tmp_path):
    """<model>.mmproj.gguf, mmproj-<model>.gguf, or a single mmproj*.gguf beside the model; two
    candidates of the last kind: none chosen. Mutation: dropping the single-file rule fails it."""
    assert find_mmproj(MODEL) == MMPROJ
    m = tmp_path / "m.gguf"
    m.write_bytes(b"")
    assert find_mmproj(m) is None
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"")
    assert find_mmproj(m) == tmp_path / "mmproj-F16.gguf"
    (tmp_path / "mmproj-Q8_0.gguf").write_bytes(b"")
    assert find_mmproj(m) is None
    (tmp_path / "mmproj-m.gguf").write_bytes(b"")
    assert find_mmproj(m) == tmp_path / "mmproj-m.gguf"


@pytest.mark.parametrize("value,says", [("qwen9vl", "unknown vision projector type 'qwen9vl'"),
                                        ("whisper", "'whisper' is an audio tower")])
def test_unknown_and_audio_projectors_refused_by_name(tmp_path, value, says):
    """Mutation: taking any projector type for gemma3's fails both."""
    from gguf_edit import copy_with_string
    bad = copy_with_string(MMPROJ, tmp_path / "mmproj.gguf", "clip.projector_type", value)
    with pytest.raises(ModelLoadError, match=says):
        load_mmproj(bad)


def test_mmproj_of_another_model_refused():
    """A projection of 32 for a text model 64 wide, and a text GGUF given as the mmproj, are
    refused saying so. Mutation: skipping the width check fails the first."""
    with pytest.raises(ModelLoadError, match="gives rows of 32, the text model's embeddings are 64"):
        load_mmproj(MMPROJ, n_embd_text=64)
    with pytest.raises(ModelLoadError, match="not an mmproj file"):
        load_mmproj(MODEL)


# ---- prompts and the engine's rules ------------------------------------------------------

def test_chat_media_joins_as_llama_server():
    """Text parts joined by newlines, none around an image (common/chat.cpp); sources in order;
    messages without images untouched. Mutation: a newline before each marker fails it."""
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                         {"type": "image_url", "image_url": {"url": "data:x"}},
                                         {"type": "text", "text": "c"}, {"type": "image", "image": b"raw"}]}]
    out, sources = chat_media(msgs)
    assert out[0] is msgs[0]
    assert out[1]["content"] == f"a\nb{MEDIA_MARKER}c{MEDIA_MARKER}"
    assert sources == ["data:x", b"raw"]


def test_placeholders_carry_image_and_offset():
    """Placeholder ids differ per image and per offset, are negative (no token), and repeat for the
    same image: block hashes over them tell images apart. Mutation: ids from the offset alone fail it."""
    a, b = placeholder_ids(b"image a", 32), placeholder_ids(b"image b", 32)
    assert a == placeholder_ids(b"image a", 32) and a != b
    assert len(set(a)) == 32 and max(a + b) < 0


def test_chunks_never_end_inside_a_bidirectional_image():
    """A chunk that would end inside such an image ends before it, or (starting at it) runs to its
    end past the budget; a causal image may be split; no chunk reaches an image whose rows are not
    encoded yet. Mutations: ignoring `bidirectional`, or the rows, fails it."""
    rows = np.zeros((20, 4), np.float32)
    m = [Media(10, 20, b"k", None, bidirectional=True, rows=rows)]
    assert chunk_past_media(m, 0, 16) == 10   # stops before the image
    assert chunk_past_media(m, 10, 8) == 20   # carries it whole
    assert chunk_past_media(m, 0, 40) == 40   # past it: as asked
    assert chunk_past_media([Media(10, 20, b"k", None, rows=rows)], 0, 16) == 16
    waiting = [Media(10, 20, b"k", np.zeros(1), bidirectional=True)]  # not encoded yet: the chunk stops before it
    assert chunk_past_media(waiting, 0, 40) == 10 and chunk_past_media(waiting, 10, 40) == 0


# ---- prompts with images against llama.cpp ------------------------------------------------

def _images_of(case) -> list[np.ndarray]:
    return [rgb(REF["images"][k]["recipe"]) for k in case["images"]]


@pytest.fixture(scope="module", params=_backends())
def vision_session(request):
    """The tiny model with its mmproj found beside it, F32 K/V as llama.cpp's record; 64-token steps, so
    that the long prompt's text spans chunks after its image (which stays whole in one)."""
    from hearthlm import SyncSession
    s = SyncSession(str(MODEL), backend=request.param, n_ctx=512, kv_cache_type="f32", max_batch_tokens=64)
    yield s
    s.close()


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompt_tokens_match_mtmd(vision_session, name):
    """The prompt's ids as mtmd_tokenize's chunks: text tokens, <start_of_image>, one placeholder per
    image row, <end_of_image>, text after each image tokenized afresh. Mutation: leaving out the end
    marker, or a BOS before the text after an image, fails it."""
    case = REF["prompts"][name]
    s = vision_session.session
    ids, media = s._place_images(s._prompt_ids(case["text"], None, media=True), _images_of(case))
    want: list = []
    for ch in case["chunks"]:
        want += ch["tokens"] if ch["type"] == "text" else [None] * ch["n_tokens"]
    assert [t if t >= 0 else None for t in ids] == want
    assert [(m.start, m.n) for m in media] == [(i, 16) for i, t in enumerate(want) if t is None][::16]


@pytest.mark.parametrize("name", sorted(REF["prompts"]))
def test_prompts_match_llama_cpp(vision_session, name):
    """Greedy steps, top-5 and their log-probs (0.05 nats, F32 on both sides) on prompts with one image,
    two, an image between text, and 336 tokens of text after one, as libmtmd computes them. Mutations:
    Gemma's sqrt(n_embd) scale on the image rows, the image rows attending causally, or the image's
    placeholders read as token 0's embedding, each fail it."""
    import golden
    case = REF["prompts"][name]
    c = vision_session.generate(case["text"], images=_images_of(case), max_tokens=len(case["greedy_ids"]),
                                temperature=0, top_logprobs=5)
    assert c.prompt_tokens == case["n_past"]
    why = golden.compare(case, c.token_ids, c.top_logprobs, c.finish_reason)
    for step, (ours, want) in enumerate(zip(c.top_logprobs, case["steps"])):
        mine = dict(ours)
        bad = [(t, mine[t], lp) for t, lp in zip(want["top_ids"], want["top_logprobs"]) if t in mine
               and abs(mine[t] - lp) > 0.05]
        if bad and why is None:
            why = f"step {step}: (token, ours, llama.cpp) {bad}"
        if c.token_ids[step] != case["greedy_ids"][step]:
            break
    assert why is None, why


def test_encoding_takes_its_share_beside_other_work(tower, monkeypatch):
    """take_turn runs a turn of about slice_s only once the forward passes since the last one have
    taken SHARE_AFTER times as long as it did while other requests have work (decoding keeps more
    than half its pace), and in long turns (ALONE_TURN_S) when nothing else waits. Mutations: a turn
    every step, or a turn of ALONE_TURN_S beside other work, each fail it."""
    import time
    from types import SimpleNamespace

    from hearthlm.runtime import vision
    from hearthlm.runtime.vision import SHARE_AFTER
    enc = VisionEncoder(tower, Placement.single(get_backend("cpu"), tower.config.n_layer), slice_s=0.01)
    turns = []

    def run(job, budget_s, first=True):
        turns.append(budget_s)
        time.sleep(budget_s or 0)
    monkeypatch.setattr(enc, "_run", run)
    px = _normalized(rgb(REF["images"]["gradient"]["recipe"]), tower)
    waiting = SimpleNamespace(media=[Media(5, 16, b"img", px)], n_computed=5, n_wanted=30)
    decoding = SimpleNamespace(media=[], n_computed=40, n_wanted=1)
    assert enc.take_turn([waiting, decoding], [waiting, decoding], 0.0)  # the first turn: at once, on a budget
    assert len(turns) == 1 and 0 < turns[0] <= 0.01 and enc.last_turn_s >= 0.01
    below = 0.9 * SHARE_AFTER * enc.last_turn_s
    assert not enc.take_turn([waiting, decoding], [waiting, decoding], below) and len(turns) == 1  # not yet
    enc.take_turn([waiting, decoding], [waiting, decoding], 1.1 * SHARE_AFTER * enc.last_turn_s)  # the passes since: long enough
    assert len(turns) == 2 and 0 < turns[1] <= 0.01
    monkeypatch.setattr(vision, "ALONE_TURN_S", 0.03)
    enc.take_turn([waiting], [waiting], 0.0)  # nothing else to do: a long turn
    assert 0.02 < turns[-1] <= 0.03 and enc.last_turn_s == 0  # alone: nothing owed after


def test_session_refusals():
    """A session opened with mmproj=False refuses images saying why; the marker count must match the
    images; token-id prompts cannot take images; an mmproj whose markers the text model lacks is
    refused at open. Mutation: a session silently dropping images it cannot see fails the first."""
    from hearthlm import SyncSession
    from hearthlm.core.errors import InvalidRequestError
    img = rgb(REF["images"]["gradient"]["recipe"])
    s = SyncSession(str(MODEL), mmproj=False, n_ctx=256)
    try:
        with pytest.raises(InvalidRequestError, match="no vision projector"):
            s.generate(f"{MEDIA_MARKER} hi", images=[img], max_tokens=1)
    finally:
        s.close()
    s = SyncSession(str(MODEL), n_ctx=256)
    try:
        with pytest.raises(InvalidRequestError, match="marks 1 image place.*for 2 image"):
            s.generate(f"{MEDIA_MARKER} hi", images=[img, img], max_tokens=1)
        with pytest.raises(InvalidRequestError, match="not token ids"):
            s.generate([2, 5, 7], images=[img], max_tokens=1)
        with pytest.raises(InvalidRequestError, match="image 1"):
            s.generate(f"{MEDIA_MARKER} hi", images=[b"not an image"], max_tokens=1)
        assert s.generate("hi", max_tokens=2, temperature=0).finish_reason  # the session goes on
    finally:
        s.close()
    from hearthlm.core.errors import ContextLengthError
    s = SyncSession(str(MODEL), n_ctx=16)
    try:
        with pytest.raises(ContextLengthError, match="image 1 is 16 rows; the context holds 16"):
            s.generate(MEDIA_MARKER, images=[img], max_tokens=1)
    finally:
        s.close()
    with pytest.raises(ModelLoadError, match="no token for"):
        SyncSession(str(DATA / "converted" / "gemma3.gguf"), mmproj=MMPROJ, n_ctx=256)


ASK = "Tell me about the picture, please, in a few words: " * 2


@pytest.mark.parametrize("prompt", [
    ASK + f"{MEDIA_MARKER} What is it?",  # the last whole block ends inside the image
    ASK + f"{MEDIA_MARKER} What is it? " + "Say what colours and shapes it has, and where they are. " * 2])
def test_prefix_cache_and_encoder_cache_know_the_image(prompt):
    """The same image asked about again: its rows come from the encoder's LRU (encoded once) and its
    KV from the prefix cache; another image after the same text reuses only the blocks before it,
    and its answer is its own (as a fresh session gives). Mutation: placeholder ids that ignore the
    image (offsets only) make the second image reuse the first's KV (the second prompt fails); reusing
    part of an image that attends both ways fails the first prompt's count."""
    from hearthlm import SyncSession
    a = rgb(REF["images"]["gradient"]["recipe"])
    b = np.random.default_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    kw = dict(max_tokens=4, temperature=0, top_logprobs=1)
    s = SyncSession(str(MODEL), n_ctx=512, kv_cache_type="f32")
    try:
        spans = [(m.start, m.end) for m in s.session._place_images(s.session._prompt_ids(prompt, None, media=True),
                                                                   [a])[1]]
        first = s.generate(prompt, images=[a], **kw)
        st0 = s.session.stats()
        again = s.generate(prompt, images=[a], **kw)
        st1 = s.session.stats()
        other = s.generate(prompt, images=[b], **kw)
        st2 = s.session.stats()
    finally:
        s.close()
    n, (start, end) = first.prompt_tokens, spans[0]
    assert again.token_ids == first.token_ids
    assert st1["images_encoded"] == st0["images_encoded"] == 1 and st1["image_cache_hits"] >= 1
    full = (n - 1) // 16 * 16  # whole blocks, the last token left to compute
    whole = start // 16 * 16 if start < full < end else full  # never a part of the image (it attends both ways)
    assert st1["prefix_cache_hit_tokens"] - st0["prefix_cache_hit_tokens"] == whole
    assert st2["prefix_cache_hit_tokens"] - st1["prefix_cache_hit_tokens"] == start // 16 * 16  # the text before b
    fresh = SyncSession(str(MODEL), n_ctx=512, kv_cache_type="f32")
    try:
        want = fresh.generate(prompt, images=[b], **kw)
    finally:
        fresh.close()
    assert other.token_ids == want.token_ids
    assert np.allclose([lp[0][1] for lp in other.top_logprobs], [lp[0][1] for lp in want.top_logprobs], atol=1e-4)


async def test_persisted_prompt_cache_keys_the_image(tmp_path):
    """cache_prefix with an image writes blocks a later session loads for the same image (same answer
    as computing it) and not for another. Mutation: placeholder ids without the image's identity load
    the first image's blocks for the second (its count fails)."""
    from hearthlm import Session
    a = rgb(REF["images"]["gradient"]["recipe"])
    b = np.random.default_rng(9).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    prefix = ASK * 2 + f"{MEDIA_MARKER} It shows" + " something, and" * 12
    opts = dict(n_ctx=512, kv_cache_type="f32", prompt_cache_dir=tmp_path)
    async with Session.open(str(MODEL), **opts) as s:
        n = await s.cache_prefix(prefix, images=[a])
    assert n > 0
    for img, loads in ((a, n), (b, None)):
        async with Session.open(str(MODEL), **opts) as s:
            c = await s.generate(prefix + " more", images=[img], max_tokens=3, temperature=0)
            got = s.stats()["prompt_cache_loaded_tokens"]
        async with Session.open(str(MODEL), **{**opts, "prompt_cache": False}) as s:
            want = await s.generate(prefix + " more", images=[img], max_tokens=3, temperature=0)
        assert c.token_ids == want.token_ids
        assert (got == loads) if loads else (got < n), (got, n)
