"""Qwen3.5-0.8B's shapes for `hearthlm bench --image --tower qwen35`: a random qwen3vl_merger
mmproj as llama.cpp's converter writes Qwen3_5ForConditionalGeneration's vision tower at --outtype
f16 (conversion/qwen3vl.py: the Conv3D split into two F16 patch kernels, learned positions F32,
matrices F16, norms and biases F32), and a random qwen35 text model at 0.8B's shapes (Q4_K_M-like
blocks, tied embeddings; a byte-level vocabulary padded to 248320 with the chat and vision
markers as single tokens). Both written once into the bench's cache directory.
Qwen/Qwen3.5-0.8B's config: vision depth 12, hidden 768, 12 heads, intermediate 3072, patch 16,
temporal patch 2, spatial merge 2, 2304 learned positions (48 x 48: 768 px), out_hidden 1024, no
deepstack; text 24 layers of width 1024 (every 4th gated attention: 8 heads of 256, 2 KV heads;
DeltaNet 16 heads of 128), FFN 3584, vocabulary 248320, rms eps 1e-6, IMROPE sections 11/11/10."""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from hearthlm.bench.vision_files import FORMAT, TowerShape, _cache_root, mmproj_writer, write_tensors
from hearthlm.core.errors import InvalidRequestError

QWEN35_VIT = TowerShape(image_size=768, patch_size=16, n_layer=12, n_embd=768, n_ff=3072, n_head=12)
N_TEXT, N_VOCAB = 1024, 248320
TEXT_MD = {"block_count": 24, "context_length": 4096, "embedding_length": N_TEXT, "feed_forward_length": 3584,
           "attention.head_count": 8, "attention.head_count_kv": 2, "attention.key_length": 256,
           "attention.value_length": 256, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e7,
           "rope.dimension_count": 64, "rope.dimension_sections": [11, 11, 10, 0], "full_attention_interval": 4,
           "ssm.conv_kernel": 4, "ssm.inner_size": 2048, "ssm.state_size": 128, "ssm.time_step_rank": 16,
           "ssm.group_count": 16}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
PROMPT = "<|im_start|>user\n<__media__>describe this image<|im_end|>\n<|im_start|>assistant\n"


def qwen3vl_tensors(s: TowerShape, n_embd_text: int) -> list[tuple[str, tuple[int, ...], type, bool]]:
    """(name, numpy shape, dtype, is a norm's gain) as the converter writes them, in its order."""
    e, f, p = s.n_embd, s.n_ff, s.patch_size
    n_pos = (s.image_size // p) ** 2
    out = [("v.patch_embd.weight", (e, 3, p, p), np.float16, False),
           ("v.patch_embd.weight.1", (e, 3, p, p), np.float16, False),
           ("v.patch_embd.bias", (e,), np.float32, False),
           ("v.position_embd.weight", (n_pos, e), np.float32, False)]
    for il in range(s.n_layer):
        b = f"v.blk.{il}."
        for ln in ("ln1", "ln2"):
            out += [(b + ln + ".weight", (e,), np.float32, True), (b + ln + ".bias", (e,), np.float32, False)]
        for name, rows, cols in (("attn_qkv", 3 * e, e), ("attn_out", e, e), ("ffn_up", f, e), ("ffn_down", e, f)):
            out += [(b + name + ".weight", (rows, cols), np.float16, False), (b + name + ".bias", (rows,), np.float32, False)]
    out += [("v.post_ln.weight", (e,), np.float32, True), ("v.post_ln.bias", (e,), np.float32, False),
            ("mm.0.weight", (4 * e, 4 * e), np.float16, False), ("mm.0.bias", (4 * e,), np.float32, False),
            ("mm.2.weight", (n_embd_text, 4 * e), np.float16, False), ("mm.2.bias", (n_embd_text,), np.float32, False)]
    return out


def write_qwen35_mmproj(path: str | os.PathLike, *, n_embd_text: int = N_TEXT, shape: TowerShape = QWEN35_VIT,
                        seed: int = 0) -> Path:
    """A qwen3vl_merger mmproj of `shape`, its tensors streamed to the file one at a time."""
    cell = shape.patch_size * 2
    if shape.image_size < cell or shape.image_size % cell:
        raise InvalidRequestError(f"image size {shape.image_size}: the Qwen3.5 tower takes a multiple of {cell} "
                                  f"(patches of {shape.patch_size}, merged 2 x 2)")
    path = Path(path)
    w = mmproj_writer(path, "Qwen3.5 Vision", shape, n_embd_text=n_embd_text, projector="qwen3vl_merger")
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(2)
    w.add_vision_attention_layernorm_eps(shape.eps)
    w.add_vision_is_deepstack_layers([False] * shape.n_layer)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return write_tensors(w, path, qwen3vl_tensors(shape, n_embd_text), seed)


def _qtype(name: str, shape: tuple[int, ...]) -> T | None:
    """Q4_K_M-like: Q6_K for the (tied) embedding, Q4_K for the matrices; vectors and the conv kernels F32."""
    if len(shape) < 2 or shape[-1] % 256 or name.endswith("conv1d.weight"):
        return None
    return T.Q6_K if name == "token_embd.weight" else T.Q4_K


def _vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode
    table = _byte_to_unicode()
    tokens = SPECIALS + [table[b] for b in range(256)] + [table[32] + "t"]  # llama.cpp needs a merge
    n_used = len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_vocab - n_used)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # a pre-tokenizer both sides know
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * 257 + [5] * (n_vocab - n_used))
    w.add_token_merges([f"{table[32]} t"])
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def write_qwen35_text(path: str | os.PathLike, *, seed: int = 0, md: dict | None = None, n_vocab: int = N_VOCAB) -> Path:
    """The qwen35 text model at 0.8B's shapes (`md`: other qwen35 hyperparameters, a test's tiny
    ones): every tensor the architecture reads (model_zoo.tensors.specs)."""
    from hearthlm.backends.random_blocks import random_blocks
    from hearthlm.model_zoo.models import get_architecture
    from hearthlm.model_zoo.tensors import specs
    arch = "qwen35"
    mod = get_architecture(arch)
    md = {f"{arch}.{k}": v for k, v in (md or TEXT_MD).items()}
    cfg = mod.Config.from_gguf(md, arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Qwen3.5-0.8B shapes (random weights, hearthlm bench)")
    for k, v in md.items():
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    _vocab(w, n_vocab)
    rng = np.random.default_rng(seed)
    for s in specs(mod, cfg, n_vocab):
        if s.optional:  # no biases; output.weight tied to token_embd
            continue
        q = _qtype(s.name, s.shape)
        if q is not None:
            w.add_tensor(s.name, random_blocks(q, int(np.prod(s.shape[:-1])), s.shape[-1], rng), raw_dtype=q)
            continue
        if s.name.endswith(".ssm_a"):  # A = -exp(A_log): a decay, never a growth
            data = -np.exp(0.5 * rng.standard_normal(s.shape))
        elif len(s.shape) == 1:
            data = 1.0 + 0.1 * rng.standard_normal(s.shape)
        else:
            data = rng.standard_normal(s.shape) / np.sqrt(s.shape[-1])
        w.add_tensor(s.name, np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _cached(name: str, key: dict, write, directory) -> Path:
    d = Path(directory) if directory else _cache_root()
    d.mkdir(parents=True, exist_ok=True)
    tag = zlib.crc32(json.dumps(dict(FORMAT=FORMAT, **key), sort_keys=True).encode())
    path = d / f"{name}-{tag:08x}.gguf"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def cached_qwen35_pair(*, seed: int = 0, directory: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(text model, mmproj) at Qwen3.5-0.8B's shapes, made on the first call. The tower's learned
    positions are 48 x 48 whatever the image (clip.cpp resizes them to its grid)."""
    text = _cached("qwen35-0.8b-random", dict(seed=seed, md=TEXT_MD, vocab=N_VOCAB, specials=SPECIALS, merges=1),
                   lambda p: write_qwen35_text(p, seed=seed), directory)
    mmproj = _cached(f"qwen35-vit-s{seed}.mmproj", dict(seed=seed, **dataclasses.asdict(QWEN35_VIT)),
                     lambda p: write_qwen35_mmproj(p, seed=seed), directory)
    return text, mmproj
