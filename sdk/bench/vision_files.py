"""Random-weight mmproj files at a real tower's shapes, for `hearthlm bench --image`: the keys,
tensor names, layouts and types llama.cpp's converter writes (convert_hf_to_gguf's
Gemma3VisionModel, --outtype f16), with random values, so that hearthlm and llama.cpp time the
same work on the same file without a download. Written once per shape into the cache directory."""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from hearthlm.core.errors import InvalidRequestError

FORMAT = 1  # bump when what the maker writes changes: cached files of another format are rewritten


@dataclass(frozen=True)
class TowerShape:
    image_size: int
    patch_size: int
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    eps: float = 1e-6


# Gemma 3's SigLIP-400M (google/gemma-3-4b-it's vision_config)
GEMMA3_SIGLIP = TowerShape(image_size=896, patch_size=14, n_layer=27, n_embd=1152, n_ff=4304, n_head=16)


def _values(seed: int, name: str, shape: tuple[int, ...], dtype, *, one: bool = False) -> np.ndarray:
    """N(0, 1) * 0.02 from a generator of (seed, the name's crc32): a tensor's values depend on
    nothing else. one: 1 + that (a norm's gain, so activations keep a trained model's scale)."""
    x = np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(shape, dtype=np.float32)
    x *= np.float32(0.02)
    if one:
        x += np.float32(1.0)
    return x.astype(dtype, copy=False)


def gemma3_tensors(s: TowerShape, n_embd_text: int) -> list[tuple[str, tuple[int, ...], type, bool]]:
    """(name, numpy shape, dtype, is a norm's gain) as the converter writes them: matrices F16
    (mm.input_projection forced F16 and stored (n_embd, n_embd_text)), the embeddings
    (".embeddings." tensors: patch kernel and positions) F32, norms and biases F32."""
    e, f, p = s.n_embd, s.n_ff, s.patch_size
    n_patches = (s.image_size // p) ** 2
    out = [("mm.input_projection.weight", (e, n_embd_text), np.float16, False),
           ("mm.soft_emb_norm.weight", (e,), np.float32, True),
           ("v.patch_embd.weight", (e, 3, p, p), np.float32, False),
           ("v.patch_embd.bias", (e,), np.float32, False),
           ("v.position_embd.weight", (n_patches, e), np.float32, False)]
    for il in range(s.n_layer):
        b = f"v.blk.{il}."
        for ln in ("ln1", "ln2"):
            out += [(b + ln + ".weight", (e,), np.float32, True), (b + ln + ".bias", (e,), np.float32, False)]
        for name, rows, cols in (("attn_q", e, e), ("attn_k", e, e), ("attn_v", e, e), ("attn_out", e, e),
                                 ("ffn_up", f, e), ("ffn_down", e, f)):
            out += [(b + name + ".weight", (rows, cols), np.float16, False), (b + name + ".bias", (rows,), np.float32, False)]
    out += [("v.post_ln.weight", (e,), np.float32, True), ("v.post_ln.bias", (e,), np.float32, False)]
    return out


def check_shape(s: TowerShape) -> None:
    cell = s.patch_size * 4  # the gemma3 projector pools 4 x 4 patches unless the file says otherwise
    if s.image_size < cell or s.image_size % cell:
        raise InvalidRequestError(f"--image-size {s.image_size}: the Gemma 3 tower takes a multiple of {cell} "
                                  f"(patches of {s.patch_size}, pooled 4 x 4)")


def mmproj_writer(path: Path, name: str, shape, *, n_embd_text: int, projector: str) -> gguf.GGUFWriter:
    """A random-weight F16 mmproj's writer with the clip.* keys every tower shares (mean and std 0.5)."""
    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_name(f"{name} (random weights, hearthlm bench)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(shape.image_size)
    w.add_vision_patch_size(shape.patch_size)
    w.add_vision_embedding_length(shape.n_embd)
    w.add_vision_feed_forward_length(shape.n_ff)
    w.add_vision_block_count(shape.n_layer)
    w.add_vision_head_count(shape.n_head)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_clip_projector_type(projector)
    return w


def write_gemma3_mmproj(path: str | os.PathLike, *, n_embd_text: int, shape: TowerShape = GEMMA3_SIGLIP,
                        seed: int = 0) -> Path:
    """Write a Gemma 3 mmproj of `shape` whose projection gives rows of `n_embd_text`; tensors
    are streamed to the file one at a time (the 400M tower never sits in memory whole)."""
    check_shape(shape)
    path = Path(path)
    w = mmproj_writer(path, "Gemma3 Vision", shape, n_embd_text=n_embd_text, projector="gemma3")
    w.add_vision_attention_layernorm_eps(shape.eps)
    w.add_vision_use_gelu(True)
    # no clip.vision.projector.scale_factor: pooled 4 x 4 at every size, as Gemma 3 at 896 (the
    # converter writes one only for a checkpoint whose image_seq_length is not 256)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return write_tensors(w, path, gemma3_tensors(shape, n_embd_text), seed)


def write_tensors(w, path: Path, tensors, seed: int) -> Path:
    """The mmproj's tensors (name, shape, dtype, ones?) as random values by seed; the file closed."""
    for name, shp, dt, _ in tensors:
        w.add_tensor_info(name, shp, np.dtype(dt), int(np.prod(shp)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, dt, one in tensors:
        w.write_tensor_data(_values(seed, name, shp, dt, one=one))
    w.close()
    return path


def cached_gemma3_mmproj(*, n_embd_text: int, image_size: int = GEMMA3_SIGLIP.image_size, seed: int = 0,
                         directory: str | os.PathLike | None = None) -> Path:
    """The random Gemma 3 mmproj at `image_size` for a text model `n_embd_text` wide, made on
    the first call (written to a temporary name, then renamed: a reader never sees half a file)."""
    shape = dataclasses.replace(GEMMA3_SIGLIP, image_size=image_size)
    check_shape(shape)
    d = Path(directory) if directory else _cache_root()
    d.mkdir(parents=True, exist_ok=True)
    key = json.dumps(dict(FORMAT=FORMAT, seed=seed, n_embd_text=n_embd_text, **dataclasses.asdict(shape)), sort_keys=True)
    path = d / f"gemma3-siglip-{image_size}-e{n_embd_text}-s{seed}-{zlib.crc32(key.encode()):08x}.mmproj.gguf"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_gemma3_mmproj(tmp, n_embd_text=n_embd_text, shape=shape, seed=seed)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _cache_root() -> Path:
    from hearthlm.runtime.weight_cache import cache_dir
    return cache_dir(kind="bench") or Path(os.environ.get("TMPDIR", "/tmp")) / "hearthlm-bench"
