"""`hearthlm bench --image --tower qwen35`'s files (hearthlm.bench.vision_qwen): the random
qwen3vl_merger mmproj has what llama.cpp's converter writes for Qwen3.5's tower, and the random
qwen35 text model loads on both sides with the vision markers as single tokens."""
from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import gguf
import pytest

from hearthlm.bench import vision as bench_vision
from hearthlm.bench import vision_qwen
from hearthlm.model_zoo.model import load_model
from hearthlm.model_zoo.vision.clip import load_mmproj

MMPROJ = Path(__file__).parent / "data" / "converted" / "qwen35-vision.mmproj.gguf"
# the converted tiny tower (tests/parity/hf spec "qwen35-vision"): its text model is 64 wide
TINY = dataclasses.replace(vision_qwen.QWEN35_VIT, image_size=32, patch_size=4, n_layer=2, n_embd=32, n_ff=64, n_head=2)
TINY_TEXT = {**vision_qwen.TEXT_MD, "block_count": 4, "embedding_length": 256, "feed_forward_length": 256,
             "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 64,
             "attention.value_length": 64, "rope.dimension_count": 16, "rope.dimension_sections": [2, 2, 4, 0],
             "ssm.inner_size": 128, "ssm.state_size": 32, "ssm.time_step_rank": 4, "ssm.group_count": 2}
LCP_PYTHON = os.environ.get(bench_vision.ENV_PYTHON, "/tmp/lcp-venv/bin/python")
GENERAL = {"general.name", "general.finetune", "general.basename", "general.size_label", "general.file_type"}


def _fields(r: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in GENERAL}


def test_maker_writes_the_converters_qwen35_mmproj(tmp_path):
    """At the converted tiny tower's shape the maker's file has its keys and values (its is_deepstack
    list included), its tensors' names and shapes (the Conv3D's two frames, 2x2-merged MLP), the F16
    split of --outtype f16 (patch kernels and matrices F16; positions, norms, biases F32), and
    load_mmproj reads it. Mutations: mm.2 written (4E, n_text) (the converter's order flipped), or
    the position table F16, each fail it."""
    path = vision_qwen.write_qwen35_mmproj(tmp_path / "q.gguf", n_embd_text=64, shape=TINY, seed=1)
    ours, conv = gguf.GGUFReader(path), gguf.GGUFReader(MMPROJ)
    assert _fields(ours) == _fields(conv)
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in conv.tensors}
    assert {t.name: tuple(int(x) for x in t.shape) for t in ours.tensors} == shapes
    for t in ours.tensors:
        f16 = len(t.shape) > 1 and t.name != "v.position_embd.weight"
        assert t.tensor_type == (gguf.GGMLQuantizationType.F16 if f16 else gguf.GGMLQuantizationType.F32), t.name
    vm = load_mmproj(path, n_embd_text=64)
    try:
        assert (vm.config.n_layer, vm.config.n_embd, vm.n_embd_out, vm.pconfig.deepstack) == (2, 32, 64, ())
    finally:
        vm.close()


def test_text_model_loads_with_single_token_markers(tmp_path):
    """The random qwen35 text model (tiny widths, the maker's vocabulary and Q4_K_M-like types) loads
    in hearthlm, its chat and vision markers one token each, and in llama.cpp where it is here.
    Mutations: the markers written as normal tokens (type 1: split into bytes), or no merge written
    (llama.cpp: "cannot find tokenizer merges"), each fail it."""
    path = vision_qwen.write_qwen35_text(tmp_path / "t.gguf", md=TINY_TEXT, n_vocab=512, seed=2)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q6_K
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q4_K
    m = load_model(str(path))
    try:
        for i, marker in enumerate(vision_qwen.SPECIALS):
            assert m.tokenizer.encode(marker, parse_special=True) == [i], marker
        ids = m.tokenizer.encode(vision_qwen.PROMPT.replace("<__media__>", ""), parse_special=True)
        assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> ... <|im_end|>
    finally:
        m.close()
    if not Path(LCP_PYTHON).is_file():
        pytest.skip(f"llama.cpp's side needs {LCP_PYTHON} (${bench_vision.ENV_PYTHON})")
    code = "import sys, llama_cpp; llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)"
    r = subprocess.run([LCP_PYTHON, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_tower_flag_picks_the_qwen_pair(monkeypatch, tmp_path):
    """--tower qwen35 (no --mmproj) benches the Qwen3.5 pair with its own chat prompt at 768 px; the
    default stays Gemma 3's. Mutation: _files ignoring --tower fails it."""
    from hearthlm.cli import build_parser
    monkeypatch.setattr(vision_qwen, "cached_qwen35_pair", lambda **kw: (tmp_path / "t.gguf", tmp_path / "m.gguf"))
    a = build_parser().parse_args(["bench", "--image", "--tower", "qwen35"])
    text, mmproj, prompt, side = bench_vision._files(a)
    assert (Path(text).name, Path(mmproj).name, side) == ("t.gguf", "m.gguf", 768)
    assert prompt == vision_qwen.PROMPT and "<|im_start|>" in prompt
    assert build_parser().parse_args(["bench", "--image"]).tower == "gemma3"
