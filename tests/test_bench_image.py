"""`hearthlm bench --image`'s pieces: the random-weight mmproj maker (hearthlm.bench.vision_files)
writes what llama.cpp's converter writes, and the command runs end to end at a tiny size."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from hearthlm.bench import vision as bench_vision
from hearthlm.bench import vision_files
from hearthlm.cli import build_parser
from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.vision.clip import load_mmproj

DATA = Path(__file__).parent / "data" / "converted"
MODEL, MMPROJ = DATA / "gemma3-vision.gguf", DATA / "gemma3-vision.mmproj.gguf"
# the converted tiny model's tower (tests/parity/hf spec "gemma3-vision"): its text model is 32 wide
TINY = vision_files.TowerShape(image_size=64, patch_size=4, n_layer=2, n_embd=64, n_ff=128, n_head=4)
LCP_PYTHON = os.environ.get(bench_vision.ENV_PYTHON, "/tmp/lcp-venv/bin/python")
GENERAL = {"general.name", "general.finetune", "general.basename", "general.size_label"}  # the checkpoint's names


def _fields(r: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in GENERAL}


def test_maker_writes_the_converters_file(tmp_path):
    """At the converted tiny tower's shape the maker's file has its keys (values but the file
    type) and its tensors' names and shapes, the F16/F32 split of an --outtype f16 conversion,
    and load_mmproj reads it with the text model's width. Mutations: mm.input_projection written
    (n_embd_text, n_embd) (converter's order flipped), or the ln gains in F16, each fail it."""
    path = vision_files.write_gemma3_mmproj(tmp_path / "t.gguf", n_embd_text=32, shape=TINY, seed=3)
    ours, conv = gguf.GGUFReader(path), gguf.GGUFReader(MMPROJ)
    fo, fc = _fields(ours), _fields(conv)
    assert fo.keys() == fc.keys()
    assert {k: v for k, v in fo.items() if k != "general.file_type"} == \
        {k: v for k, v in fc.items() if k != "general.file_type"}
    assert fo["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in conv.tensors}
    assert {t.name: tuple(int(x) for x in t.shape) for t in ours.tensors} == shapes
    for t in ours.tensors:
        f16 = t.name == "mm.input_projection.weight" or (len(t.shape) == 2 and t.name.startswith("v.blk."))
        assert t.tensor_type == (gguf.GGMLQuantizationType.F16 if f16 else gguf.GGMLQuantizationType.F32), t.name
    w = {t.name: np.asarray(t.data, np.float32) for t in ours.tensors}
    assert abs(w["v.blk.0.ffn_up.weight"].std() - 0.02) < 0.002  # N(0, 1) * 0.02
    assert abs(w["v.blk.1.ln2.weight"].mean() - 1) < 0.01         # a norm's gain about 1
    vm = load_mmproj(path, n_embd_text=32)
    try:
        assert (vm.config.n_layer, vm.config.n_embd, vm.config.image_size, vm.n_embd_out) == (2, 64, 64, 32)
    finally:
        vm.close()
    again = vision_files.write_gemma3_mmproj(tmp_path / "u.gguf", n_embd_text=32, shape=TINY, seed=3)
    assert again.read_bytes() == path.read_bytes()  # seeded: the same file each time


def test_maker_refuses_a_size_that_does_not_pool(monkeypatch):
    """An image size whose patch grid is no multiple of the 4 x 4 pool (100 px: 25 patches of 4)
    is refused by name. Mutation: check_shape returning at once fails it."""
    monkeypatch.setattr(vision_files, "GEMMA3_SIGLIP", TINY)
    with pytest.raises(InvalidRequestError, match="--image-size 100"):
        vision_files.cached_gemma3_mmproj(n_embd_text=32, image_size=100)


def _run(capsys, *extra: str) -> str:
    a = build_parser().parse_args(["bench", "--image", "--model", str(MODEL), "--image-size", "32", "--repeat", "2",
                                   "--n-ctx", "512", *extra])
    a.run(a)
    # the table, without the log's lines (a first compile's warning, when no earlier test compiled the kernels)
    return "\n".join(ln for ln in capsys.readouterr().out.splitlines() if " [warning  ] " not in ln)


def test_command_prints_its_table(capsys, monkeypatch):
    """`hearthlm bench --image` (no --mmproj) makes the random tower at --image-size with the text
    model's width, times the encode and the first token, and prints the table with the host's CPU
    and load average, and the profile with --profile. Mutations: the encode rows not timed (0), or
    the maker sized by the tower's width instead of the text model's (load_mmproj refuses), each fail it."""
    monkeypatch.setattr(vision_files, "GEMMA3_SIGLIP", dataclasses.replace(TINY, image_size=896))
    out = _run(capsys, "--profile")
    lines = out.splitlines()
    assert "image: 32x32 (4 tokens)" in lines[0] and "threads: 2" in lines[0]
    assert lines[1].startswith("cpu: ") and "load average" in lines[1]
    head = lines[2].split()
    assert head[:5] == ["engine", "load_s", "first_encode_s", "encode_s", "ttft_s"]
    row = next(ln.split() for ln in lines if ln.split()[:1] == ["hearthlm"])
    assert all(float(x) > 0 for x in row[1:6])
    assert "attention (attn_full)" in out and "matmul ffn_up" in out
    made = list((Path(os.environ["HEARTHLM_CACHE_DIR"]) / "bench").glob("gemma3-siglip-32-e32-*.mmproj.gguf"))
    assert len(made) == 1


@pytest.mark.skipif(not Path(LCP_PYTHON).is_file(), reason=f"llama.cpp's side needs an interpreter with "
                    f"llama-cpp-python's mtmd bindings (${bench_vision.ENV_PYTHON}, else {LCP_PYTHON}): none here")
def test_command_against_llama_cpp(capsys, monkeypatch):
    """--compare-llama-cpp adds llama.cpp's row (mtmd on the same file and pixels, its rounds in turn
    with hearthlm's) and the ratio, what llama.cpp's flash attention default resolved to, and the
    build and the host. Mutations: the ratio taken llama.cpp / hearthlm, or the build's facts not
    passed on from the child's first line, each fail it."""
    monkeypatch.setenv(bench_vision.ENV_PYTHON, LCP_PYTHON)
    out = json.loads(_run(capsys, "--mmproj", str(MMPROJ), "--compare-llama-cpp", "--json"))
    ours, theirs, ratio = out["rows"]
    assert (ours["engine"], theirs["engine"], ratio["engine"]) == ("hearthlm", "llama.cpp", "ratio")
    for k in ("first_encode_s", "encode_s", "ttft_s"):
        assert theirs[k] > 0 and ratio[k] == pytest.approx(ours[k] / theirs[k])
    assert len(out["llama_cpp_encode_rounds"]) == len(out["llama_cpp_ttft_rounds"]) == 2
    assert out["llama_cpp_image_tokens"] == out["image_tokens"] == 16
    assert theirs["flash_attn"] in ("enabled", "disabled") and out["mtmd_flash_attn_type"] == -1
    # the one yardstick's facts (hearthlm.bench.yardstick): the build and the host
    assert out["llama_cpp"]["python"] == LCP_PYTHON and "AVX" in out["llama_cpp"]["system_info"]
    assert out["host"]["cpu"] and len(out["load_start"]) == len(out["load_end"]) == 3


# a tower whose encode takes about a second here: long beside the tiny text model's steps (~1 ms)
STREAMS_TOWER = vision_files.TowerShape(image_size=448, patch_size=14, n_layer=8, n_embd=512, n_ff=2048, n_head=8)


def test_streams_keep_their_share_beside_images(capsys, monkeypatch):
    """`bench --image --streams 4`: four streams decoding on the tiny text model keep at least about
    half their rate beside a client sending new images back to back (0.4: a noisy shared 2-core
    machine), and no stream waits much longer than a turn of the tower between two tokens (its
    whole encode takes ~1 s). Mutation: take_turn's turns beside other work as long as alone
    (ALONE_TURN_S) fails it (a gap of ~1 s)."""
    monkeypatch.setattr(vision_files, "GEMMA3_SIGLIP", STREAMS_TOWER)
    a = build_parser().parse_args(["bench", "--image", "--model", str(MODEL), "--image-size", "448", "--streams", "4",
                                   "--decode-tokens", "440", "--json"])
    a.run(a)
    out = capsys.readouterr().out
    f = json.loads(out[out.index("{"):])  # the JSON (a first compile's warning may precede it)
    assert f["alone"]["tokens"] == f["beside"]["tokens"] == 4 * 439
    assert f["beside"]["encode_s"] > 0.15 * f["beside"]["tokens"] / f["beside"]["tok_s"]  # the tower did run beside
    assert f["ratio"] >= 0.4, f
    assert f["beside"]["worst_gap_s"] < 0.4, f
