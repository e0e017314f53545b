"""RoPE parameters as GGUF states them, and the op parameters they give (as llama.cpp's
hparams/cparams feed `ggml_rope_ext`). Scaling kinds: none, linear, YaRN, LongRoPE (the
`rope.scaling.type` values llama.cpp knows), and per-dimension frequency factors from a
tensor: Llama 3's `rope_freqs.weight`, LongRoPE's `rope_factors_short/long.weight`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from hearthlm.core.errors import ModelLoadError

SCALING_TYPES = ("none", "linear", "yarn", "longrope")
FREQS = "rope_freqs.weight"  # Llama 3(.1/.2): per-dimension divisors of the frequencies
LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"  # LongRoPE (Phi-3)


@dataclass(frozen=True)
class Rope:
    n_rot: int                # dimensions rotated per head (the first n_rot)
    base: float               # rope.freq_base
    neox: bool                # halves rotated together (NeoX) or adjacent pairs (normal)
    scaling: str = "none"     # rope.scaling.type
    freq_scale: float = 1.0   # 1 / rope.scaling.factor (linear, YaRN)
    n_ctx_orig: int = 0       # rope.scaling.original_context_length (YaRN's ramp, LongRoPE's long/short)
    attn_factor: float = 1.0  # rope.scaling.attn_factor: cos/sin magnitude (LongRoPE's)
    yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier, where the architecture reads it (mistral3)
    beta_fast: float = 32.0   # YaRN ramp bounds (llama.cpp's defaults)
    beta_slow: float = 1.0
    long: bool = False        # LongRoPE: the context exceeds n_ctx_orig (see for_context)
    # per-dimension frequency divisors by tensor name, from the file (see bind)
    factors: tuple[tuple[str, tuple[float, ...]], ...] = ()

    @classmethod
    def from_gguf(cls, r, *, n_rot: int, neox: bool, base: float = 10000.0) -> "Rope":
        """`r`: the architecture's config.Reader. An unknown scaling type is refused."""
        scaling = r.get("rope.scaling.type", "linear", str)  # llama.cpp's default: linear (factor 1)
        if scaling not in SCALING_TYPES:
            raise ModelLoadError(f"GGUF metadata {r.key('rope.scaling.type')!r} = {scaling!r}: unknown RoPE "
                                 f"scaling type (supported: {', '.join(SCALING_TYPES)})")
        factor = r.get("rope.scaling.factor", 0.0, float, positive=False)
        return cls(n_rot=n_rot, base=r.opt("rope.freq_base", base, float), neox=neox, scaling=scaling,
                   freq_scale=1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor,
                   n_ctx_orig=r.opt("rope.scaling.original_context_length", r.need("context_length")),
                   attn_factor=r.opt("rope.scaling.attn_factor", 1.0, float))

    def for_context(self, n_ctx: int) -> "Rope":
        """LongRoPE picks its long factors for contexts past the original one (llama.cpp's
        get_rope_factors on n_ctx_seq)."""
        return dataclasses.replace(self, long=n_ctx > self.n_ctx_orig)

    def bind(self, weights) -> "Rope":
        """With the file's frequency-factor tensors (`weights`: name -> QWeight), checked."""
        found = tuple((n, tuple(float(v) for v in factor_values(weights[n], self.n_rot)))
                      for n in (FREQS, LONG, SHORT) if n in weights)
        return dataclasses.replace(self, factors=found)

    @property
    def active_factors(self) -> np.ndarray | None:
        """rope_freqs where present (llama.cpp's get_rope_factors), else LongRoPE's long or short."""
        have = dict(self.factors)
        f = have.get(FREQS) or have.get(LONG if self.long else SHORT)
        return None if f is None else np.array(f, np.float64)

    def params(self) -> dict:
        """Graph.rope keyword arguments. Plain RoPE keeps (base, freq_scale); anything else
        is folded into per-dimension frequencies `freqs` (theta_i = pos * freqs[i]) and a cos/sin
        magnitude `mscale`, computed as ggml's rope_yarn does."""
        factors = self.active_factors
        ext = 1.0 if self.scaling == "yarn" else 0.0
        attn = self.attn_factor * self._yarn_attn_factor() if ext else self.attn_factor
        p = dict(n_rot=self.n_rot, base=self.base, freq_scale=self.freq_scale, neox=self.neox)
        if factors is None and ext == 0.0 and attn == 1.0:
            return p
        half = self.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        theta = self.base ** (-2.0 * i / self.n_rot) / (1.0 if factors is None else factors.astype(np.float64))
        mix = self.freq_scale
        if ext:
            lo, hi = _yarn_corr_dims(self.n_rot, self.n_ctx_orig, self.base, self.beta_fast, self.beta_slow)
            ramp = (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)) * ext
            mix = self.freq_scale * (1.0 - ramp) + ramp
            attn *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return {**p, "freqs": tuple(float(f) for f in theta * mix), "mscale": float(attn)}

    def _yarn_attn_factor(self) -> float:
        """llama.cpp's cparams.yarn_attn_factor for YaRN: mscale over the one rope_yarn applies."""
        factor = 1.0 / self.freq_scale
        get = lambda s, m: 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        a = get(factor, 1.0) / get(factor, self.yarn_log_mul) if self.yarn_log_mul else get(factor, 1.0)
        return a / (1.0 + 0.1 * math.log(factor))


def _yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float):
    dim = lambda n_rot: n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def factor_values(w, n_rot: int) -> np.ndarray:
    """The float32 values of a frequency-factor tensor (a QWeight), checked."""
    if w.ggml_type != 0 or w.shape != (n_rot // 2,):  # 0: F32
        raise ModelLoadError(f"tensor {w.name!r}: expected F32 of shape ({n_rot // 2},), got type {w.ggml_type} "
                             f"shape {w.shape}")
    return np.frombuffer(w.raw.tobytes(), np.float32)
