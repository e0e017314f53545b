"""mmproj files: the clip.* hyperparameters (llama.cpp tools/mtmd/clip.cpp's clip_model_loader),
the tensors, and the projector module that builds the tower. A file whose projector this
project does not run, an audio tower, or a projection that does not fit the text model is a
ModelLoadError naming it."""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np

from hearthlm.core.errors import GGUFError, ModelLoadError
from hearthlm.core.graph import Graph
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.gguf_file import GGUFFile
from hearthlm.model_zoo.tensors import Weights
from hearthlm.runtime.vision import ImageBatch

# projector type (clip.projector_type / clip.vision.projector_type) -> the module in this package
PROJECTORS = {"gemma3": "gemma3", "qwen3vl_merger": "qwen3vl", "qwen2.5vl_merger": "qwen25vl", "gemma4v": "gemma4v"}
PROJECTORS.update({"idefics3": "idefics3", "lfm2": "lfm2"})  # the tiled ones (tiles plus an overview)
PROJECTORS["pixtral"] = "pixtral"  # Mistral 3 (Pixtral-12B, Mistral Small 3.1, Ministral 3)
PROJECTORS["gemma4uv"] = "gemma4uv"  # Gemma 4 12B ("unified"): no tower
NO_TOWER = ("gemma4uv",)  # block_count and head_count 0: the patches are projected straight into the text model
AUDIO = ("whisper", "ultravox", "qwen2a", "qwen3a", "voxtral", "glma", "lfm2a", "gemma4a", "gemma4ua", "conformer",
         "musicflamingo")


@dataclass(frozen=True)
class ClipConfig:
    projector: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    image_size: int
    patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    act: str                  # the FFN's: "gelu" (tanh), "silu" or "gelu_quick" (clip.use_gelu / use_silu)
    scale_factor: int = 0     # clip.vision.projector.scale_factor where the file has it (0: the projector's default)
    extra: dict = field(default_factory=dict)


def read_config(md: dict[str, Any], where: str) -> ClipConfig:
    def get(key: str, default=None, kind=int):
        v = md.get(key, default)
        if v is None:
            raise ModelLoadError(f"{where}: the mmproj has no {key}")
        try:
            return tuple(kind(x) for x in v) if isinstance(v, (list, tuple, np.ndarray)) else kind(v)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: {key} = {v!r} is not a {kind.__name__}") from e

    if md.get("clip.has_vision_encoder") is False or "clip.vision.embedding_length" not in md:
        if md.get("clip.has_audio_encoder"):
            raise ModelLoadError(f"{where}: an audio mmproj (projector {_proj_type(md)!r}): audio input is not "
                                 "supported yet, only images")
        raise ModelLoadError(f"{where}: the mmproj has no vision encoder (clip.vision.* keys)")
    proj = _proj_type(md)
    if proj in AUDIO:
        raise ModelLoadError(f"{where}: projector {proj!r} is an audio tower: audio input is not supported yet")
    if proj not in PROJECTORS:
        raise ModelLoadError(f"{where}: unknown vision projector type {proj!r}; this version runs "
                             f"{', '.join(sorted(PROJECTORS))}")
    n_embd, n_head = get("clip.vision.embedding_length"), get("clip.vision.attention.head_count")
    tower = proj not in NO_TOWER
    if tower and (n_head <= 0 or n_embd % n_head):
        raise ModelLoadError(f"{where}: clip.vision.attention.head_count {n_head} does not divide {n_embd}")
    if md.get("clip.use_gelu") and md.get("clip.use_silu"):
        raise ModelLoadError(f"{where}: both clip.use_gelu and clip.use_silu are set")
    mean, std = get("clip.vision.image_mean", kind=float), get("clip.vision.image_std", kind=float)
    if len(mean) < 3 or len(std) < 3 or min(abs(s) for s in std[:3]) == 0:
        raise ModelLoadError(f"{where}: clip.vision.image_mean/image_std need 3 values, std non-zero")
    c = ClipConfig(
        projector=proj, n_embd=n_embd, n_ff=get("clip.vision.feed_forward_length"),
        n_layer=get("clip.vision.block_count"), n_head=n_head,
        n_head_kv=get("clip.vision.attention.head_count_kv", n_head),
        head_dim=get("clip.vision.attention.head_dim", n_embd // n_head if n_head > 0 else 0),
        eps=get("clip.vision.attention.layer_norm_epsilon", 1e-6, float),
        image_size=get("clip.vision.image_size"), patch_size=get("clip.vision.patch_size"),
        mean=mean[:3], std=std[:3],
        act="gelu" if md.get("clip.use_gelu") else "silu" if md.get("clip.use_silu") else "gelu_quick",
        scale_factor=get("clip.vision.projector.scale_factor", 0))
    if not tower and c.n_layer != 0:
        raise ModelLoadError(f"{where}: block_count {c.n_layer}: the {proj} projector has no layers")
    if c.patch_size <= 0 or c.image_size < c.patch_size or c.n_layer < (1 if tower else 0):
        raise ModelLoadError(f"{where}: image_size {c.image_size}, patch_size {c.patch_size}, block_count "
                             f"{c.n_layer}: not a vision tower")
    return c


def _proj_type(md) -> str:
    p = md.get("clip.vision.projector_type") or md.get("clip.projector_type") or md.get("clip.audio.projector_type")
    return p if isinstance(p, str) else "(none)"


@dataclass(frozen=True)
class Piece:
    """A token of an image's layout found by its text, as mtmd's lookup_token finds it (the lowest id whose
    piece is exactly `text`), where mtmd adds token ids rather than tokenizing text ("\n\n" before
    idefics3's overview)."""
    text: str


@dataclass(eq=False)
class Slice:
    """One image chunk of an image's layout (the image itself, a tile or an overview): as the tower takes
    it, its rows and their identity."""
    pixels: np.ndarray      # (3, H, W) float32
    n: int                  # its rows
    key: bytes              # the decoded image's, this file's and the slice's index
    grid: tuple[int, int]   # (nx, ny): its rows across and down (VisionModel.grid)


@dataclass(eq=False)
class VisionModel:
    path: str
    file: GGUFFile
    config: ClipConfig
    proj: ModuleType          # model_zoo.vision.<projector>: build, preprocess, tokens, markers
    pconfig: Any              # the projector's own config (proj.Config)
    weights: dict[str, QWeight]
    n_embd_out: int           # rows' width: the text model's n_embd (n_embd_inp: Qwen3-VL's are wider)
    digest: str               # the file's identity (image cache keys carry it)
    _views: dict = field(default_factory=dict, repr=False)

    def build_graph(self, shape: ImageBatch) -> Graph:
        """The tower for `shape`: input "pixels" (B, 3, H, W); output 0 the image rows, (B * n, n_embd_out),
        more outputs where the projector returns (output, [columns...]): columns of
        the rows computed on the way (Qwen3-VL's deepstack), which the encoder appends to them."""
        g = Graph()
        w = Weights(g, self.weights, 0, where=self.path, arch=f"{self.config.projector} projector", views=self._views)
        out = self.proj.build(self.config, self.pconfig, g, w, shape)
        g.outputs += [out[0], *out[1]] if isinstance(out, tuple) else [out]
        return g

    @property
    def bidirectional(self) -> bool:
        """Whether an image's rows attend to each other both ways in the text model (llama.cpp's
        mtmd_decode_use_non_causal): the projector's BIDIRECTIONAL, or its bidirectional(text width)."""
        rule = getattr(self.proj, "bidirectional", None)
        return bool(rule(self.n_embd_out) if rule is not None else self.proj.BIDIRECTIONAL)

    def prepare(self, image) -> tuple[np.ndarray, int, bytes]:
        """An image (vision.image.Image) that is one chunk as the tower takes it: (pixels (3, H, W)
        float32, its number of rows, its identity: the decoded pixels' and this file's). A tiled
        image has several: `layout`."""
        slices = [p for p in self.layout(image) if isinstance(p, Slice)]
        if len(slices) != 1:
            raise ValueError(f"the {self.config.projector} projector makes this image {len(slices)} chunks: "
                             "use layout()")
        return slices[0].pixels, slices[0].n, slices[0].key

    def layout(self, image) -> list[str | Piece | Slice]:
        """An image as mtmd_tokenize lays it out, in prompt order: text (tokenized with special tokens parsed),
        tokens found by their text (Piece) and image chunks (Slice): a projector's `layout` (tiles and an
        overview between their markers), else its BEGIN marker, the image and its END marker. Each slice's key
        is the image's and the slice's: the first one's the key `prepare` gives."""
        if hasattr(self.proj, "layout"):
            parts = self.proj.layout(self.config, self.pconfig, image.pixels)
        else:
            parts = [self.proj.BEGIN, self.proj.preprocess(self.config, self.pconfig, image.pixels), self.proj.END]
        out: list[str | Piece | Slice] = []
        for part in parts:
            if isinstance(part, np.ndarray):
                k = sum(isinstance(p, Slice) for p in out)
                key = hashlib.blake2b(image.digest + self.digest.encode() + (k.to_bytes(4, "little") if k else b""),
                                      digest_size=16).digest()
                n = self.proj.n_tokens(self.config, self.pconfig, part.shape[1], part.shape[2])
                out.append(Slice(part, n, key, self.grid(part)))
            elif part:
                out.append(part)
        return out

    def grid(self, pixels: np.ndarray) -> tuple[int, int]:
        """(nx, ny): the rows of a prepared image across and down, as an M-RoPE text model places
        them (clip_n_output_tokens_x / _y); a projector without a grid: one line of its rows."""
        h, w = pixels.shape[1:]
        if hasattr(self.proj, "grid"):
            return self.proj.grid(self.config, self.pconfig, h, w)
        return self.proj.n_tokens(self.config, self.pconfig, h, w), 1

    def check_text_model(self, model) -> None:
        """The projector's image markers must be tokens of the text model (an mmproj of another family fails)."""
        tok = model.tokenizer
        for text in (self.proj.BEGIN, self.proj.END):
            if text and len(tok.encode(text, parse_special=True)) != 1:
                raise ModelLoadError(f"{self.path}: the {self.config.projector} projector marks images with "
                                     f"{text!r}, which {model.path}'s vocabulary has no token for: this mmproj "
                                     "belongs to another model")
        for text in getattr(self.proj, "TOKENS", ()):  # the layout's tokens found by their text (Piece)
            if tok.piece_id(text) is None:
                raise ModelLoadError(f"{self.path}: the {self.config.projector} projector lays out images with the "
                                     f"token {text!r}, which {model.path}'s vocabulary has none of: this mmproj "
                                     "belongs to another model")

    def inputs(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        """The tower's inputs besides the pixels (B, 3, H, W): each patch's position row and image
        (or the projector's own, where it has more)."""
        if hasattr(self.proj, "inputs"):
            return self.proj.inputs(self.config, self.pconfig, pixels)
        p = self.config.patch_size
        b, n = pixels.shape[0], (pixels.shape[2] // p) * (pixels.shape[3] // p)
        return dict(patch_pos=np.tile(np.arange(n, dtype=np.int32), b), seg=np.repeat(np.arange(b, dtype=np.int32), n))

    def close(self) -> None:
        self.file.close()


def load_mmproj(path, *, n_embd_text: int | None = None) -> VisionModel:
    """Open an mmproj file; `n_embd_text`: the text model's width, which the projection must give."""
    try:
        f = GGUFFile.open(path)
    except GGUFError:
        raise
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the mmproj file: {e}") from e
    try:
        if f.metadata.get("general.architecture") != "clip":
            raise ModelLoadError(f"{path}: not an mmproj file (general.architecture is "
                                 f"{f.metadata.get('general.architecture')!r}, not 'clip')")
        cfg = read_config(f.metadata, str(path))
        proj = importlib.import_module(f"hearthlm.model_zoo.vision.{PROJECTORS[cfg.projector]}")
        weights = {t.name: _as_weight(t, str(path)) for t in f.tensors.values()}
        pcfg = proj.Config.read(cfg, f.metadata, weights, str(path))
        out = proj.n_embd_out(cfg, pcfg, weights)
        if n_embd_text is not None and out != n_embd_text:
            raise ModelLoadError(f"{path}: the {cfg.projector} projector gives rows of {out}, the text model's "
                                 f"embeddings are {n_embd_text} wide: this mmproj belongs to another model")
        ident = json.dumps(f.identity(), sort_keys=True, default=str).encode()
        vm = VisionModel(str(path), f, cfg, proj, pcfg, weights, out, hashlib.blake2b(ident, digest_size=16).hexdigest())
        _check_graph(vm)
        return vm
    except BaseException:
        f.close()
        raise


def _as_weight(t, where: str) -> QWeight:
    """The file's tensor as a weight; a conv kernel (n_embd, C, p, p) as the matrix (n_embd, C*p*p)
    that multiplies PATCHIFY's rows."""
    qw = QWeight(t.name, int(t.ggml_type), tuple(t.shape), t.raw())
    if len(qw.shape) == 4:
        if qw.ggml_type not in (0, 1, 30):  # F32, F16, BF16: a row of the kernel is p values, no blocks
            raise ModelLoadError(f"{where}: tensor {t.name!r} is a conv kernel of ggml type {qw.ggml_type}; "
                                 "only float kernels are read")
        n = qw.shape[0]
        qw = QWeight(t.name, qw.ggml_type, (n, int(np.prod(qw.shape[1:]))), qw.raw.reshape(n, -1))
    return qw


def conv_half(a: np.ndarray) -> np.ndarray:
    """Values at half precision: ggml_conv_2d's im2col is F16 (for any kernel but BF16), so llama.cpp's
    patch embedding multiplies F16 pixels by F16 kernel values; the towers take the same values."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def half_kernel(weights: dict, name: str) -> None:
    """weights[name], a float conv kernel (as a matrix), replaced by its values at half precision
    (conv_half); a BF16 kernel, which ggml multiplies at F32, is left as it is."""
    qw = weights.get(name)
    if qw is None or qw.ggml_type not in (0, 1):
        return
    a = qw.raw.view(np.float32 if qw.ggml_type == 0 else np.float16).reshape(qw.shape)
    h = np.ascontiguousarray(conv_half(a))
    weights[name] = QWeight(name, 0, h.shape, h.view(np.uint8))


def transposed(qw: QWeight) -> QWeight:
    """A matrix stored (in, out) that ggml multiplies transposed (gemma3's mm.input_projection):
    as an F32 (out, in) weight."""
    a = qw.raw if qw.ggml_type == 0 else None
    a = (gguf.quants.dequantize(qw.raw, qw.ggml_type) if a is None else a.view(np.float32)).reshape(qw.shape)
    t = np.ascontiguousarray(a.T, np.float32)
    return QWeight(qw.name + ".T", 0, t.shape, t.view(np.uint8))


def _check_graph(vm: VisionModel) -> None:
    """Build the tower once: every tensor it reads exists with the shape it declares."""
    from hearthlm.core.errors import HearthError
    try:
        s = vm.config.image_size  # or the projector's own size (its image_size unused: gemma4v's)
        h, wd = vm.proj.warmup_size(vm.config, vm.pconfig) if hasattr(vm.proj, "warmup_size") else (s, s)
        vm.build_graph(ImageBatch(1, h, wd))
    except HearthError:
        raise
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"{vm.path}: tensor shapes do not fit the {vm.config.projector} projector: {e}") from e


def find_mmproj(model_path: str | Path) -> Path | None:
    """An mmproj beside the model, by the names llama-server and LM Studio pair: <model>.mmproj.gguf,
    mmproj-<model>.gguf, then a single mmproj*.gguf in the folder."""
    p = Path(model_path)
    if not p.is_file():
        return None
    stem = p.name[:-5] if p.name.endswith(".gguf") else p.name
    for name in (f"{stem}.mmproj.gguf", f"mmproj-{stem}.gguf"):
        if (p.parent / name).is_file():
            return p.parent / name
    found = sorted(q for q in p.parent.glob("mmproj*.gguf") if q.is_file())
    return found[0] if len(found) == 1 else None

