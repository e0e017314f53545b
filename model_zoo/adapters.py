"""LoRA adapters in the GGUF form llama.cpp's convert_lora_to_gguf.py writes (general.type
"adapter", adapter.type "lora", adapter.lora.alpha; tensors `<base tensor>.lora_a` (rank, n_in)
and `.lora_b` (n_out, rank) in numpy order), validated against the model they adapt as
llama.cpp's llama_adapter_lora_init does; the set a session holds (chosen per request, batched
together, freed once no request uses them); and the graph hook that puts the step's adapters on
every weight's product (core.graph.Op.LORA; never merged into the weights)."""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from hearthlm.core.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.gguf_file import GGUFFile

_keys = itertools.count(1)


@dataclass(eq=False)
class LoraAdapter:
    name: str
    key: str    # unique per load ("name#n"): graphs, prepared weights and prefix blocks are keyed by it
    path: str
    alpha: float  # 0: the scale alone (llama.cpp's get_scale)
    # base tensor name -> (A (r, n_in) as the file's, B^T (r, n_out)): the kernels' layout; F16 where the
    # file's pair is F16 (half the bytes each token reads), else float32

    pairs: dict[str, tuple[QWeight, QWeight]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def _floats(path, t) -> np.ndarray:
    """A tensor's values as float32 (F32, F16, BF16, Q8_0 and whatever gguf.quants reads)."""
    raw = t.raw()
    try:
        if t.ggml_type == T.F32:
            return np.array(raw.view(np.float32).reshape(t.shape))
        if t.ggml_type == T.F16:
            return raw.view(np.float16).astype(np.float32).reshape(t.shape)
        return np.asarray(quants.dequantize(raw, T(t.ggml_type)), np.float32).reshape(t.shape)
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: LoRA tensor {t.name!r} of type {t.ggml_type.name} cannot be read: {e}") \
            from e


def _weight(name: str, a: np.ndarray) -> QWeight:
    """An F32 or F16 record of a (a copy: the file closes)."""
    a = np.ascontiguousarray(a, np.float16 if a.dtype == np.float16 else np.float32)
    return QWeight(name, int(T.F16 if a.dtype == np.float16 else T.F32), a.shape, a.view(np.uint8).reshape(a.shape[0], -1))


def load_adapter(path, name: str, model) -> LoraAdapter:
    """Open and validate a LoRA GGUF against `model` (a model_zoo.model.Model); ModelLoadError
    (ModelNotFoundError for a missing file) naming the first problem: not a LoRA adapter, another
    architecture, a tensor the model lacks, shapes that do not fit it."""
    f = GGUFFile.open(path)
    try:
        md = f.metadata
        if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
            raise ModelLoadError(f"{path}: not a LoRA adapter (general.type {md.get('general.type')!r}, "
                                 f"adapter.type {md.get('adapter.type')!r}; want 'adapter', 'lora')")
        arch = md.get("general.architecture")
        if arch != model.arch_name:
            raise ModelLoadError(f"{path}: a LoRA adapter for {arch!r}; the model is {model.arch_name!r}")
        alpha = md.get("adapter.lora.alpha", 0.0)
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ModelLoadError(f"{path}: adapter.lora.alpha is {alpha!r}, not a finite number")
        if md.get("adapter.alora.invocation_tokens") is not None:
            raise UnsupportedModelError(f"{path}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
        halves: dict[str, dict[str, object]] = {}
        for t in f.tensors.values():
            if t.name.endswith((".lora_a", ".lora_b")):
                halves.setdefault(t.name[:-7], {})[t.name[-1]] = t
            elif not t.name.endswith("_norm.weight"):  # llama.cpp skips norm vectors too
                raise ModelLoadError(f"{path}: LoRA tensor {t.name!r} has an unexpected suffix (want .lora_a / .lora_b)")
        if not halves:
            raise ModelLoadError(f"{path}: the adapter has no .lora_a / .lora_b tensors")
        ad = LoraAdapter(name, f"{name}#{next(_keys)}", str(path), float(alpha))
        for base in sorted(halves):
            ta, tb = halves[base].get("a"), halves[base].get("b")
            if ta is None or tb is None:
                raise ModelLoadError(f"{path}: LoRA tensor pair for {base!r} is missing its lora_{'a' if ta is None else 'b'}")
            w = model.weights.get(base)
            if w is None:
                raise ModelLoadError(f"{path}: LoRA tensor {base!r} does not exist in the base model (a LoRA for "
                                     "another model?)")
            if base == "token_embd.weight" or len(w.shape) != 2:
                raise UnsupportedModelError(f"{path}: LoRA on {base!r} {tuple(w.shape)} is not supported (2-D "
                                            "projections only: no embedding or expert adapters yet)")
            n_out, n_in = w.shape
            sa, sb = tuple(ta.shape), tuple(tb.shape)
            if len(sa) != 2 or len(sb) != 2 or sa[1] != n_in or sb[0] != n_out or sa[0] != sb[1] or sa[0] == 0:
                raise ModelLoadError(f"{path}: LoRA tensor {base!r} has shapes lora_a {sa}, lora_b {sb}; the model's "
                                     f"{base} is {tuple(w.shape)}, so want lora_a (rank, {n_in}), lora_b ({n_out}, rank)")
            if ta.ggml_type == tb.ggml_type == T.F16:
                a, b = (t.raw().view(np.float16).reshape(t.shape) for t in (ta, tb))
            else:
                a, b = _floats(path, ta), _floats(path, tb)
            ad.pairs[base] = (_weight(f"{base}.lora_a@{ad.key}", a), _weight(f"{base}.lora_b@{ad.key}", b.T))
        return ad
    finally:
        f.close()


class AdapterSet:
    """The adapters a model holds, by name. `live` (key -> adapter; replaced whole on each change, so
    the engine thread reads a consistent one) is what graphs are built over; an unloaded adapter that
    requests still use stays live until the last of them releases it."""

    def __init__(self) -> None:
        self.live: dict[str, LoraAdapter] = {}
        self.names: dict[str, str] = {}  # name -> key
        self._uses: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, ad: LoraAdapter) -> None:
        with self._lock:
            old = self.names.get(ad.name)
            self.names[ad.name] = ad.key
            self.live = {**self.live, ad.key: ad}
            if old is not None:
                self._retire(old)

    def remove(self, name: str) -> None:
        with self._lock:
            key = self.names.pop(name, None)
            if key is None:
                raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded")
            self._retire(key)

    def _retire(self, key: str) -> None:
        if not self._uses.get(key):
            self.live = {k: v for k, v in self.live.items() if k != key}

    def resolve(self, adapters) -> tuple[tuple[str, float], ...]:
        """A request's {name: scale} as (key, scale) pairs by key; InvalidRequestError naming an
        unknown adapter or a bad scale. Scale 0 adapters are left out (they change nothing)."""
        if adapters is None:
            return ()
        if not isinstance(adapters, dict):
            raise InvalidRequestError(f"adapters must be a dict of name -> scale, not {type(adapters).__name__}")
        out = []
        for name, scale in adapters.items():
            key = self.names.get(name)
            if key is None:
                known = ", ".join(sorted(self.names)) or "none"
                raise InvalidRequestError(f"unknown LoRA adapter {name!r} (loaded: {known})")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise InvalidRequestError(f"LoRA adapter {name!r}: scale {scale!r} is not a finite number")
            if scale:
                out.append((key, float(np.float32(scale))))
        return tuple(sorted(out))

    def hold(self, lora) -> None:
        with self._lock:
            for key, _ in lora:
                self._uses[key] = self._uses.get(key, 0) + 1

    def release(self, lora) -> None:
        with self._lock:
            for key, _ in lora:
                n = self._uses[key] = self._uses[key] - 1
                if n == 0:
                    del self._uses[key]
                    if key not in self.names.values():
                        self._retire(key)

    def paths(self) -> dict[str, str]:
        return {name: self.live[key].path for name, key in self.names.items()}


def lora_hook(adapters: list[LoraAdapter | None], n_tokens: int):
    """Graph.lora_hook for a step over `adapters` (its "lora_scale" input: (n_tokens, len(adapters)),
    each token's scale per adapter, 0 where its request does not use it): the adapters that have the
    weight put their products on y. The LM head's rows are the output rows: their scales gathered."""
    gathered: dict[int, Tensor] = {}

    def hook(g: Graph, w: Tensor, x: Tensor, y: Tensor, il: int) -> Tensor:
        used = [(i, ad) for i, ad in enumerate(adapters) if ad is not None and w.name in ad.pairs]
        if not used or len(x.shape) != 2:
            return y
        scales = g.inputs.get("lora_scale") or g.input("lora_scale", (n_tokens, len(adapters)), F32)
        if x.shape[0] != n_tokens:  # the LM head over the output rows
            out_rows = g.inputs["out_rows"]
            assert x.shape[0] == out_rows.shape[0], f"{y.name}: {x.shape[0]} rows, neither tokens nor output rows"
            if x.shape[0] not in gathered:
                gathered[x.shape[0]] = g.get_rows(scales, out_rows, "lora_scale_out")
            scales = gathered[x.shape[0]]
        pairs = [(g.weight(ad.pairs[w.name][0]), g.weight(ad.pairs[w.name][1])) for _, ad in used]
        return g.lora(y, x, scales, pairs, cols=[i for i, _ in used], alphas=[ad.alpha for _, ad in used],
                      name=f"{y.name}_lora", il=il)
    return hook
