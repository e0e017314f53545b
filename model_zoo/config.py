"""Architecture hyperparameters from GGUF metadata, read once for all architectures (as
llama.cpp's load_hparams, then each architecture's load_arch_hparams). Keys are read under
the file's own `general.architecture` prefix, so an alias reads its own keys; every error
names the key."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.layer_memory import LayerMemory
from hearthlm.model_zoo.rope import Rope


class Reader:
    """`r.need("block_count")` reads `<arch>.block_count`."""

    def __init__(self, md: Mapping[str, Any], arch: str) -> None:
        self.md, self.arch = md, arch

    def key(self, k: str) -> str:
        return f"{self.arch}.{k}"

    def need(self, k: str, kind: type = int) -> Any:
        """A required positive number (int, or float with kind=float)."""
        if self.key(k) not in self.md:
            raise ModelLoadError(f"GGUF metadata lacks required key {self.key(k)!r}")
        return self.get(k, None, kind)

    def opt(self, k: str, default: Any, kind: type = int) -> Any:
        """An optional positive number, `default` when absent."""
        return self.get(k, default, kind)

    def swa_layers(self, period: int) -> tuple[bool, ...]:
        """Per layer, whether it slides (llama.cpp's load_swa_pattern): the file's
        attention.sliding_window_pattern, one bool a layer or a period (every layer but each
        period-th: period 0 all), else `period`."""
        n_layer, key = self.need("block_count"), self.key("attention.sliding_window_pattern")
        v = self.md[key] if key in self.md else period  # `in`: test writers see the key read
        if isinstance(v, int) and not isinstance(v, bool):
            return tuple(v == 0 or il % v < v - 1 for il in range(n_layer))
        v = list(v)
        if len(v) != n_layer or not all(isinstance(x, (bool, int)) or hasattr(x, "dtype") for x in v):
            raise ModelLoadError(f"GGUF metadata {key!r} must be {n_layer} bools (one per layer), got {v[:8]!r}")
        return tuple(bool(x) for x in v)

    def experts(self) -> tuple[int, int]:
        """(expert_count, expert_used_count), required, the second no more than the first."""
        n_expert, used = self.need("expert_count"), self.need("expert_used_count")
        if used > n_expert:
            raise ModelLoadError(f"GGUF metadata {self.key('expert_used_count')!r} = {used} exceeds "
                                 f"{self.key('expert_count')!r} = {n_expert}")
        return n_expert, used

    def per_layer(self, k: str, n_layer: int) -> tuple[int, ...] | None:
        """A per-layer array of ints >= 0 (llama.cpp's get_key_or_arr), or None where the key is
        absent or a single number."""
        v = self.md[self.key(k)] if self.key(k) in self.md else None
        if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iub":  # as the GGUF reader gives it
            v = [int(x) for x in v]
        if not isinstance(v, (list, tuple, np.ndarray)):
            return None
        if len(v) != n_layer or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise ModelLoadError(f"GGUF metadata {self.key(k)!r} must be {n_layer} ints >= 0 (one per layer), "
                                 f"got {list(v)[:8]!r}{'...' if len(v) > 8 else ''}")
        return tuple(v)

    def get(self, k: str, default: Any, kind: type = int, *, positive: bool = True) -> Any:
        key = self.key(k)
        if key not in self.md:
            return default
        v = self.md[key]
        if kind is str:
            if not isinstance(v, str):
                raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be a string")
            return v
        if kind is bool:
            if not isinstance(v, bool):
                raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be a bool")
            return v
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if not ok:
            raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be {'a number' if kind is float else 'an int'}")
        if positive and not v > 0 or v < 0:
            raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be {'positive' if positive else '>= 0'}")
        if not math.isfinite(v):
            raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be finite")
        return kind(v)


@dataclass(frozen=True)
class HParams:
    """What every architecture reads. An architecture's Config subclasses it: class
    attributes for its defaults, extra fields (with defaults) filled by `read`."""
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int            # 0 where the file has none (MoE-only models)
    n_ctx_train: int
    norm_eps: float
    rope: Rope
    sliding_window: int  # 0: none
    head_count_kv_layers: tuple[int, ...] = ()  # per layer where the file gives an array (0: no attention)

    NEOX: ClassVar[bool] = False          # the architecture's RoPE layout (llama.cpp's rope_type)
    CAUSAL: ClassVar[bool] = True         # False: an encoder (each input runs whole, attending both ways)
    PER_LAYER_KV_HEADS: ClassVar[bool] = False  # True: builds with n_head_kv_of(il), so the counts may differ
    NORM_EPS: ClassVar[float] = 1e-5
    ROPE_BASE: ClassVar[float] = 10000.0
    MROPE: ClassVar[str] = ""             # the M-RoPE kind (model_zoo.rope.MROPE_KINDS) of llama.cpp's rope type

    @classmethod
    def from_gguf(cls, md: Mapping[str, Any], arch: str) -> "HParams":
        r = Reader(md, arch)
        n_embd, n_head = r.need("embedding_length"), r.need("attention.head_count")
        head_dim = r.opt("attention.key_length", n_embd // n_head)
        if r.opt("attention.value_length", head_dim) != head_dim:
            raise ModelLoadError(f"GGUF metadata {r.key('attention.value_length')!r} differs from "
                                 f"{r.key('attention.key_length')!r} ({head_dim}): not supported")
        n_layer = r.need("block_count")
        kv_layers = r.per_layer("attention.head_count_kv", n_layer)  # hybrids: 0 on recurrent layers
        if kv_layers is not None and len(set(kv_layers) - {0}) > 1 and not cls.PER_LAYER_KV_HEADS:
            raise ModelLoadError(f"GGUF metadata {r.key('attention.head_count_kv')!r}: attention layers with "
                                 f"different KV head counts {sorted(set(kv_layers) - {0})} are not supported")
        n_head_kv = (max(kv_layers) or n_head) if kv_layers else r.opt("attention.head_count_kv", n_head)
        ff_layers = r.per_layer("feed_forward_length", n_layer)  # Gemma 4: wider FFNs on some layers
        base = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                    head_count_kv_layers=kv_layers or (),
                    n_ff=max(ff_layers) if ff_layers else r.opt("feed_forward_length", 0), n_ctx_train=r.need("context_length"),
                    norm_eps=r.opt("attention.layer_norm_rms_epsilon", cls.NORM_EPS, float),
                    rope=Rope.from_gguf(r, n_rot=r.opt("rope.dimension_count", head_dim), neox=cls.NEOX,
                                        base=cls.ROPE_BASE, mrope=cls.MROPE),
                    sliding_window=r.get("attention.sliding_window", 0, positive=False))  # phi3 writes 0: none
        return cls(**base, **cls.read(r))

    @classmethod
    def read(cls, r: Reader) -> dict:
        """The architecture's own keys."""
        return {}

    def __post_init__(self) -> None:
        for h in {self.n_head_kv, *self.head_count_kv_layers} - {0}:
            if self.n_head % h:
                raise ModelLoadError(f"head_count {self.n_head} is not a multiple of head_count_kv {h}")
        if self.rope.n_rot > self.head_dim or self.rope.n_rot % 2:
            raise ModelLoadError(f"rope.dimension_count {self.rope.n_rot} does not fit head dim {self.head_dim}")

    @property
    def n_embd_inp(self) -> int:
        """The width of an embedding input (an image's rows): n_embd, wider where they carry more
        (llama.cpp's n_embd_inp: Qwen3-VL's deepstack slices)."""
        return self.n_embd

    def layer_memory(self) -> list[LayerMemory]:
        """Per layer, what it keeps between steps (core.layer_memory): the one declaration the KV
        cache, the recurrent state and the attention windows are built from. An architecture sets
        it through the per-layer hooks below."""
        out = []
        for il in range(self.n_layer):
            if not self.has_attention(il):
                out.append(LayerMemory(state=self.state_of(il)))
            elif self.kv_source(il) != il:
                out.append(LayerMemory(window=self.window_of(il), kv_from=self.kv_source(il)))
            else:
                out.append(LayerMemory(self.n_head_kv_of(il), self.head_dim_of(il), window=self.window_of(il)))
        return out

    def n_head_kv_of(self, il: int) -> int:
        """Layer il's K/V head count: the file's per-layer array where it has one."""
        return self.head_count_kv_layers[il] if self.head_count_kv_layers else self.n_head_kv

    def head_dim_of(self, il: int) -> int:
        return self.head_dim

    def has_attention(self, il: int) -> bool:
        return True

    def window_of(self, il: int) -> int:
        """Layer il's sliding window (0: it attends over every position)."""
        return 0

    def kv_source(self, il: int) -> int:
        """The layer whose K/V layer il attends over (itself, but for Gemma 4's shared layers)."""
        return il

    def uses_rope(self, il: int) -> bool:
        """Whether layer il's attention rotates Q and K (SmolLM3 and Granite 4.0-H have NoPE layers)."""
        return True

    def state_of(self, il: int) -> dict[str, tuple[int, ...]]:
        """A recurrent layer's per-sequence state shapes by cache name (hybrid models)."""
        return {}
