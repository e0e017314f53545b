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
MROPE_KINDS = ("mrope", "imrope", "vision")  # ggml's rope_multi modes: Qwen2-VL, Qwen3-VL / Qwen3.5, the towers'
N_POS = 4  # position components of an M-RoPE token: (t, h, w, e), as llama.cpp's n_pos_per_embd
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
    # M-RoPE: rope.dimension_sections (pairs per component t, h, w, e) and the kind ("mrope": in
    # runs, "imrope": interleaved); a token's position is then N_POS components (Inputs.rope_pos)
    sections: tuple[int, ...] = ()
    mrope: str = ""

    @classmethod
    def from_gguf(cls, r, *, n_rot: int, neox: bool, base: float = 10000.0, mrope: str = "") -> "Rope":
        """`r`: the architecture's config.Reader. An unknown scaling type is refused. `mrope`: the
        architecture's M-RoPE kind, its sections read from rope.dimension_sections (required)."""
        scaling = r.get("rope.scaling.type", "linear", str)  # llama.cpp's default: linear (factor 1)
        if scaling not in SCALING_TYPES:
            raise ModelLoadError(f"GGUF metadata {r.key('rope.scaling.type')!r} = {scaling!r}: unknown RoPE "
                                 f"scaling type (supported: {', '.join(SCALING_TYPES)})")
        factor = r.get("rope.scaling.factor", 0.0, float, positive=False)
        return cls(n_rot=n_rot, base=r.opt("rope.freq_base", base, float), neox=neox, scaling=scaling,
                   freq_scale=1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor,
                   n_ctx_orig=r.opt("rope.scaling.original_context_length", r.need("context_length")),
                   attn_factor=r.opt("rope.scaling.attn_factor", 1.0, float),
                   sections=_sections(r, n_rot) if mrope else (), mrope=mrope)

    @property
    def n_pos(self) -> int:
        """Position components per token: N_POS with M-RoPE, else 1."""
        return N_POS if self.mrope else 1

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
        if self.mrope:  # text M-RoPE: pair i keeps its frequency, its position is a component's
            p["comps"] = mrope_pairs(self.n_rot // 2, self.sections, self.mrope)[0]
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


def mrope_pairs(n_pairs: int, sections, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(component, exponent) of each rotated pair as ggml_mrope_cache_init assigns them: pair i
    turns by pos[component] * theta_scale^exponent. "mrope": the components in runs of the sections
    (t, h, w, then e); "imrope": interleaved t, h, w, t, h, w ... while each lasts (3 * its section),
    then e; "vision": in runs, each run's exponent restarting at 0. Only "vision" changes exponents."""
    s0, s1, s2, _ = sections
    total, sec_w = sum(sections), s0 + s1
    sec_e = sec_w + s2
    comps, expos, e = [], [], [0, 0, 0, 0]  # each component's exponent so far
    for i in range(n_pairs):
        sector = i % total
        if kind == "vision":  # a component restarts where its run starts (ggml's indep_sects: its else-ifs)
            k = next((k for k, start in enumerate((0, s0, sec_w, sec_e)) if sector == start), None)
            if k is not None:
                e[k] = 0
        if kind == "imrope":
            c = (1 if sector % 3 == 1 and sector < 3 * s1 else 2 if sector % 3 == 2 and sector < 3 * s2
                 else 0 if sector % 3 == 0 and sector < 3 * s0 else 3)
        else:
            c = 0 if sector < s0 else 1 if sector < sec_w else 2 if sector < sec_e else 3
        comps.append(c)
        expos.append(e[c])
        e = [x + 1 for x in e]
    return tuple(comps), tuple(expos)


def vision_rope(head_dim: int, base: float = 10000.0) -> dict:
    """Graph.rope keyword arguments of a tower's 2D RoPE (ggml_rope_multi in vision mode, as Qwen's
    towers call it: sections head_dim/4 each, n_dims head_dim/2): the whole head turns in NeoX pairs
    (i, i + head_dim/2), a run by each patch's row then a run by its column (positions (y, x, y, x)),
    each run's frequencies restarting at 1."""
    q = head_dim // 4
    comps, expos = mrope_pairs(head_dim // 2, (q, q, q, q), "vision")
    freqs = tuple(float(base ** (-2.0 * e / (head_dim // 2))) for e in expos)
    return dict(n_rot=head_dim, base=base, neox=True, freqs=freqs, comps=comps)


def _sections(r, n_rot: int) -> tuple[int, ...]:
    """rope.dimension_sections: 4 counts of pairs (llama.cpp reads up to 4), not all 0, their sum
    within the head (ggml asserts it)."""
    key = r.key("rope.dimension_sections")
    v = r.md.get(key) if key in r.md else None
    if v is None:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r} (M-RoPE sections)")
    try:
        v = [int(x) for x in v]
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"GGUF metadata {key!r} = {v!r} must be up to 4 ints") from e
    v = (v + [0, 0, 0, 0])[:4] if len(v) <= 4 else v
    if len(v) != 4 or min(v) < 0 or not sum(v) or sum(v) > n_rot:
        raise ModelLoadError(f"GGUF metadata {key!r} = {v!r}: M-RoPE needs up to 4 counts >= 0, not all 0, "
                             f"summing to at most {n_rot}")
    return tuple(v)


def _yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float):
    dim = lambda n_rot: n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def factor_values(w, n_rot: int) -> np.ndarray:
    """The float32 values of a frequency-factor tensor (a QWeight), checked."""
    if w.ggml_type != 0 or w.shape != (n_rot // 2,):  # 0: F32
        raise ModelLoadError(f"tensor {w.name!r}: expected F32 of shape ({n_rot // 2},), got type {w.ggml_type} "
                             f"shape {w.shape}")
    return np.frombuffer(w.raw.tobytes(), np.float32)
