"""The RoPE parameter type: GGUF scaling metadata to op parameters, against a direct port of
ggml's rope_yarn / ggml_rope_cache_init (ggml-cpu/ops.cpp) and llama.cpp's cparams."""
import math

import numpy as np
import pytest

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.weights import QWeight
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.rope import FREQS, LONG, SHORT, Rope


def ggml_theta(pos, n_dims, base, fs, ext, attn, n_ctx_orig, ff=None, beta_fast=32.0, beta_slow=1.0):
    """(theta per pair, cos/sin magnitude) as ggml computes them."""
    corr = lambda b: n_dims * math.log(n_ctx_orig / (b * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(0, math.floor(corr(beta_fast))), min(n_dims - 1, math.ceil(corr(beta_slow)))
    out, mscale = [], attn
    for i in range(n_dims // 2):
        extrap = pos * base ** (-2 * i / n_dims) / (1.0 if ff is None else ff[i])
        theta = fs * extrap
        if ext:
            ramp = (1 - min(1, max(0, (i - lo) / max(0.001, hi - lo)))) * ext
            theta = theta * (1 - ramp) + extrap * ramp
        out.append(theta)
    if ext:
        mscale *= 1 + 0.1 * math.log(1 / fs)
    return np.array(out), mscale


def rope_of(md, arch="llama", n_rot=64, neox=False):
    return Rope.from_gguf(Reader({"llama.context_length": 4096, **md}, arch), n_rot=n_rot, neox=neox)


def test_plain_rope_keeps_base_params():
    p = rope_of({"llama.rope.freq_base": 5e5}).params()
    assert p == dict(n_rot=64, base=5e5, freq_scale=1.0, neox=False)


def test_linear_scaling():
    p = rope_of({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}).params()
    assert p["freq_scale"] == 0.25 and "freqs" not in p


def test_yarn_matches_ggml():
    r = rope_of({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                 "llama.rope.scaling.original_context_length": 2048, "llama.rope.freq_base": 1e6})
    p = r.params()
    # llama.cpp: yarn_attn_factor = get_mscale(4) / (1 + 0.1 ln 4) = 1; rope_yarn multiplies (1 + 0.1 ln 4) back
    want, mscale = ggml_theta(1.0, 64, 1e6, 0.25, 1.0, 1.0, 2048)
    assert np.allclose(p["freqs"], want, rtol=1e-12) and p["mscale"] == pytest.approx(mscale)
    assert p["mscale"] == pytest.approx(1 + 0.1 * math.log(4))
    assert not np.allclose(want, 0.25 * 1e6 ** (-np.arange(32) / 32))  # the ramp mixes in extrapolation


def test_llama3_factors_from_the_file():
    ff = np.concatenate([np.ones(16), np.full(16, 8.0)]).astype(np.float32)
    r = rope_of({"llama.rope.freq_base": 5e5}).bind({FREQS: QWeight(FREQS, 0, (32,), ff.view(np.uint8)[None])})
    want, _ = ggml_theta(1.0, 64, 5e5, 1.0, 0.0, 1.0, 4096, ff=ff.astype(np.float64))
    assert np.allclose(r.params()["freqs"], want, rtol=1e-12) and r.params()["mscale"] == 1.0


def test_longrope_picks_short_or_long_by_context():
    short, long = np.ones(32, np.float32), np.linspace(1, 40, 32).astype(np.float32)
    ws = {n: QWeight(n, 0, (32,), v.view(np.uint8)[None]) for n, v in ((SHORT, short), (LONG, long))}
    r = rope_of({"llama.rope.scaling.attn_factor": 1.19, "llama.rope.scaling.original_context_length": 4096},
                neox=True).bind(ws)
    assert np.allclose(r.for_context(4096).params()["freqs"], ggml_theta(1.0, 64, 1e4, 1.0, 0, 1, 4096, short)[0])
    assert np.allclose(r.for_context(8192).params()["freqs"], ggml_theta(1.0, 64, 1e4, 1.0, 0, 1, 4096, long)[0])
    assert r.params()["mscale"] == pytest.approx(1.19)


def test_unknown_scaling_type_is_named():
    with pytest.raises(ModelLoadError, match="'llama.rope.scaling.type' = 'dynamic-ntk'"):
        rope_of({"llama.rope.scaling.type": "dynamic-ntk"})


def test_misshapen_factor_tensor_is_named():
    with pytest.raises(ModelLoadError, match="rope_freqs.weight"):
        rope_of({}).bind({FREQS: QWeight(FREQS, 0, (16,), np.ones(16, np.float32).view(np.uint8)[None])})
