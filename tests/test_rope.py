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


def ggml_mrope_thetas(p, sections, kind, ne0, n_dims, base):
    """ggml_mrope_cache_init (ggml-cpu/ops.cpp), ported line by line: each pair's theta at positions
    p = (t, h, w, e); imrope interleaves, vision restarts each component at its run (indep_sects)."""
    scale = base ** (-2.0 / n_dims)
    th = list(map(float, p))
    s0, s1, s2, s3 = sections
    sect_dims, sec_w = s0 + s1 + s2 + s3, s0 + s1
    sec_e = s2 + sec_w
    out = []
    for i0 in range(0, ne0, 2):
        sector = (i0 // 2) % sect_dims
        if kind == "vision":
            if sector == 0:
                th[0] = p[0]
            elif sector == s0:
                th[1] = p[1]
            elif sector == sec_w:
                th[2] = p[2]
            elif sector == sec_e:
                th[3] = p[3]
        theta = th[0]
        if kind == "imrope":
            if sector % 3 == 1 and sector < 3 * s1:
                theta = th[1]
            elif sector % 3 == 2 and sector < 3 * s2:
                theta = th[2]
            elif sector % 3 == 0 and sector < 3 * s0:
                theta = th[0]
            else:
                theta = th[3]
        elif sec_w > sector >= s0:
            theta = th[1]
        elif sec_w + s2 > sector >= sec_w:
            theta = th[2]
        elif sector >= sec_w + s2:
            theta = th[3]
        out.append(theta)
        th = [x * scale for x in th]
    return np.array(out)


@pytest.mark.parametrize("kind,sections,n_rot,head", [("imrope", (11, 11, 10, 0), 64, 256), ("imrope", (2, 1, 1, 0), 8, 32),
                                                      ("mrope", (16, 24, 24, 0), 128, 128), ("vision", (18,) * 4, 72, 72),
                                                      ("vision", (4,) * 4, 16, 16)])
def test_mrope_pairs_match_ggml(kind, sections, n_rot, head):
    """Each pair's component and exponent give ggml's theta at distinct positions (t, h, w, e): the text
    kinds rotate n_rot dims (pairs i, i + n_rot/2), the vision kind the whole head with n_dims = head/2.
    Mutations: imrope's h and w swapped, or vision's runs not restarting, each fail it."""
    from hearthlm.model_zoo.rope import mrope_pairs
    p = (1000.0, 37.0, 5.0, 11.0)
    n_pairs, n_dims = (head // 2, head // 2) if kind == "vision" else (n_rot // 2, n_rot)
    comps, expos = mrope_pairs(n_pairs, sections, kind)
    ours = np.array([p[c] * 1e4 ** (-2.0 * e / n_dims) for c, e in zip(comps, expos)])
    want = ggml_mrope_thetas(p, sections, kind, head, n_dims, 1e4)[:n_pairs]
    np.testing.assert_allclose(ours, want, rtol=1e-9)


def test_mrope_reads_the_sections():
    """An M-RoPE architecture's Rope reads rope.dimension_sections and gives the op its components;
    missing or impossible sections are named. Mutation: dropping comps from params fails it."""
    base = {"qwen35.context_length": 512}
    r = Rope.from_gguf(Reader({**base, "qwen35.rope.dimension_sections": [2, 1, 1, 0]}, "qwen35"), n_rot=8,
                       neox=True, mrope="imrope")
    assert r.sections == (2, 1, 1, 0) and r.n_pos == 4 and r.params()["comps"] == (0, 1, 2, 0)
    assert "comps" not in rope_of({}).params() and rope_of({}).n_pos == 1
    with pytest.raises(ModelLoadError, match="lacks required key 'qwen35.rope.dimension_sections'"):
        Rope.from_gguf(Reader(base, "qwen35"), n_rot=8, neox=True, mrope="imrope")
    for bad in ([0, 0, 0, 0], [2, -1, 1, 0], [4, 4, 4, 4, 1], [8, 8, 0, 0]):
        with pytest.raises(ModelLoadError, match="M-RoPE needs up to 4 counts"):
            Rope.from_gguf(Reader({**base, "qwen35.rope.dimension_sections": bad}, "qwen35"), n_rot=8, neox=True,
                           mrope="imrope")
