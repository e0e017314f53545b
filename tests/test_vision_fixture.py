"""The image-input fixtures (#39) are what they say: a placeholder until the real parity test (hearthlm's
vision tower and image rows against tests/data/vision_parity.json) exists. Read with hearthlm's GGUF
reader, no llama.cpp: the mmproj (tests/parity/hf/make.py's "gemma3-vision" through llama.cpp's converter
with --mmproj) is a Gemma 3 projector with the shapes the spec asked for; the text file is gemma3 with
the vision markers as control tokens; the recorded rows are n_image_tokens x the text model's n_embd,
and each image's recipe regenerates the pixels llama.cpp was given."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

from hearthlm.model_zoo.gguf_file import GGUFFile

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from record_vision import rgb  # noqa: E402

DATA = Path(__file__).parent / "data"
TEXT, MMPROJ = DATA / "converted" / "gemma3-vision.gguf", DATA / "converted" / "gemma3-vision.mmproj.gguf"
CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


@pytest.fixture(scope="module")
def files():
    with GGUFFile.open(TEXT) as text, GGUFFile.open(MMPROJ) as proj:
        yield text, proj


@pytest.fixture(scope="module")
def rec():
    return json.loads((DATA / "vision_parity.json").read_text())


def test_mmproj_is_a_gemma3_projector(files):
    """Mutation: converting without --mmproj's second pass (the text file twice) fails the architecture;
    image_size 32 in the spec (8x8 patches, 4 tokens after llama.cpp's pooling by 4) fails the shapes."""
    text, proj = files
    md = proj.metadata
    assert proj.architecture == "clip" and md["general.type"] == "mmproj"
    assert md.get("clip.projector_type", md.get("clip.vision.projector_type")) == "gemma3"
    assert (md["clip.vision.image_size"], md["clip.vision.patch_size"]) == (64, 4)
    assert (md["clip.vision.embedding_length"], md["clip.vision.feed_forward_length"]) == (64, 128)
    assert (md["clip.vision.block_count"], md["clip.vision.attention.head_count"]) == (2, 4)
    assert md["clip.vision.projection_dim"] == text.metadata["gemma3.embedding_length"]
    assert "clip.vision.projector.scale_factor" not in md  # llama.cpp's default pooling, 4 per side
    t = proj.tensors
    assert {n.split(".")[0] for n in t} == {"v", "mm"}
    assert t["v.position_embd.weight"].shape == ((64 // 4) ** 2, 64)
    assert t["v.patch_embd.weight"].shape == (64, 3, 4, 4)
    # HF's (vision, text) matrix as it is (x @ W, not a Linear's W.T); the converter forces it to F16
    assert t["mm.input_projection.weight"].shape == (64, 32) and t["mm.input_projection.weight"].ggml_type.name == "F16"
    assert all(x.ggml_type.name == "F32" for n, x in t.items() if n != "mm.input_projection.weight")
    assert t["mm.soft_emb_norm.weight"].shape == (64,)
    for il in range(2):
        for k in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down", "ln1", "ln2"):
            assert f"v.blk.{il}.{k}.weight" in t and f"v.blk.{il}.{k}.bias" in t
    assert "v.blk.2.attn_q.weight" not in t


def test_text_model_is_gemma3_with_the_image_markers(files):
    """Mutation: leaving <start_of_image> out of the spec's special tokens (a normal piece) fails it."""
    text, _ = files
    assert text.architecture == "gemma3"
    toks, types = text.metadata["tokenizer.ggml.tokens"], text.metadata["tokenizer.ggml.token_type"]
    for tok in ("<start_of_image>", "<end_of_image>", "<image_soft_token>"):
        assert types[toks.index(tok)] == CONTROL, tok


def test_recorded_rows_are_image_tokens_by_n_embd(files, rec):
    """Mutation: recording mtmd_get_output_embd as n_tokens x n_embd_vision (64), or one row short, fails it."""
    text, proj = files
    n_embd = text.metadata["gemma3.embedding_length"]
    side = proj.metadata["clip.vision.image_size"] // proj.metadata["clip.vision.patch_size"] // 4
    assert rec["n_embd"] == n_embd and side * side == 16
    for name, im in rec["images"].items():
        assert im["shape"] == [side * side, n_embd], name
        assert len(im["rows"]) == side * side and all(len(r) == n_embd for r in im["rows"]), name
    for name, p in rec["prompts"].items():
        images = [c for c in p["chunks"] if c["type"] == "image"]
        assert [c["id"] for c in images] == p["images"], name
        assert all(c["n_tokens"] == c["n_pos"] == side * side for c in images), name
        assert p["n_past"] == sum(c["n_pos"] for c in p["chunks"]), name
        assert len(p["first_logprobs"]) == len(text.metadata["tokenizer.ggml.tokens"]), name


def test_recipes_regenerate_the_pixels(rec):
    """Mutation: the gradient's blue channel from x alone, or another noise seed, fails it."""
    for name, im in rec["images"].items():
        px = rgb(im["recipe"])
        assert px.shape == (im["recipe"]["ny"], im["recipe"]["nx"], 3), name
        assert hashlib.sha256(px.tobytes()).hexdigest() == im["sha256"], name


def test_settings_are_f32_kv_without_flash_attention(rec):
    """Mutation: recording with llama-cpp-python's default K/V type (f16, 1) fails it."""
    s = rec["settings"]
    assert (s["type_k"], s["type_v"], s["flash_attn"]) == (0, 0, False)
    assert rec["non_causal"] is True and all(c["non_causal"] for p in rec["prompts"].values()
                                            for c in p["chunks"] if c["type"] == "image")
