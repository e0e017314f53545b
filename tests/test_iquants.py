"""The i-quant / MXFP4 / TQ unpackers reproduce gguf.quants.dequantize bitwise."""

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.cpu.iquants import IQUANT_UNPACKERS, LUTS
from hearthlm.backends.cpu.qtypes import KINDS, _pack_codes
from hearthlm.backends.random_blocks import F16_FIELDS, IQUANTS

# type -> (sub, byte offsets of its float16 scales within a block: the shared table)
SUBS = {T.IQ2_XS: 16, T.IQ2_S: 16, T.IQ1_M: 16}
TYPES = {t: (SUBS.get(t, 32), F16_FIELDS.get(t, ())) for t in IQUANTS}
SHAPES = [(3, 512), (5, 256 * 3), (1, 256)]


def _random_f16(rng, n, extreme=False):
    """Sane finite scales of either sign, a few exact zeros among them; or, extreme, any
    finite float16 (subnormals to 65504)."""
    if extreme:
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        return np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).view(np.float16)
    d = rng.uniform(0.001, 0.02, n) * rng.choice([-1, 1], n)
    d[rng.random(n) < 0.05] = 0
    return d.astype(np.float16)


def random_raw(qtype, n_rows, n_cols, seed=0, extreme=False):
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_cols // block
    b = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for off in TYPES[qtype][1]:
        b[:, off:off + 2] = _random_f16(rng, n_blocks, extreme).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.MXFP4:  # e8m0 exponent: d = 2^(e-128); sane: not tiny; extreme: 12 d stays finite
        b[:, 0] = rng.integers(0, 251, n_blocks) if extreme else rng.integers(100, 131, n_blocks)
    if qtype == T.IQ1_M:  # d is split into the top nibbles of the 4 uint16 scale words
        bits = _random_f16(rng, n_blocks, extreme).view(np.uint16)
        sc = np.ascontiguousarray(b[:, 48:56]).view("<u2") & 0x0FFF
        sc |= ((bits[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF) << 12
        b[:, 48:56] = sc.view(np.uint8)
    return b.reshape(n_rows, -1)


def weights(out):
    layout, sub, codes, d, m, c = out
    if layout in LUTS:  # the lookup layouts: codes index the type's table
        codes = np.array(LUTS[layout], np.int8)[codes]
    return np.repeat(d, sub, axis=1) * (codes.astype(np.float32) + np.float32(c))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
def test_exact(qtype, shape):
    n_rows, n_cols = shape
    raw = random_raw(qtype, n_rows, n_cols, seed=n_cols + int(qtype))
    ref = gq.dequantize(raw, qtype)
    assert ref.shape == shape and np.isfinite(ref).all()
    layout, sub, codes, d, m, c = out = IQUANT_UNPACKERS[int(qtype)](raw, n_rows, n_cols)
    assert sub == TYPES[qtype][0] and m is None
    assert d.dtype == np.float32 and d.shape == (n_rows, n_cols // sub)
    assert codes.shape == shape
    if qtype in (T.TQ1_0, T.TQ2_0):
        assert (layout, c) == ("nib", -1) and codes.dtype == np.uint8
        # TQ1_0's base-3 digits are 0..2; TQ2_0's 2-bit fields may also hold 3 (decodes to +2)
        assert set(np.unique(codes)) == ({0, 1, 2} if qtype == T.TQ1_0 else {0, 1, 2, 3})
    elif qtype in (T.IQ4_NL, T.IQ4_XS, T.MXFP4):  # 4-bit indices into the type's table
        assert (layout, c) == ({T.MXFP4: "mxfp4"}.get(qtype, "iq4nl"), 0) and codes.dtype == np.uint8
        assert codes.max() <= 15 and len(np.unique(codes)) == 16
    else:
        assert (layout, c) == ("i8", 0) and codes.dtype == np.int8
        assert np.abs(codes.astype(np.int16)).max() <= 127
        assert len(np.unique(codes)) >= 6  # a decode, not a constant
    got = weights(out)
    assert got.dtype == np.float32
    bad = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
    assert np.array_equal(got, ref), f"{bad.size} differ, e.g. {got.ravel()[bad[:3]]} vs {ref.ravel()[bad[:3]]}"
    assert bad.size == 0  # bitwise, signed zeros included


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
def test_exact_extreme_scales(qtype):
    # IQ1_*'s dl / 8 stays exact even for float16 subnormals (float32 has room below them)
    raw = random_raw(qtype, 64, 512, seed=int(qtype), extreme=True)
    ref = gq.dequantize(raw, qtype)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 1e3
    got = weights(IQUANT_UNPACKERS[int(qtype)](raw, 64, 512))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_ternary_values():
    # TQ2_0: 2-bit fields q give q - 1; byte 0x1B holds fields 3, 2, 1, 0 (3 is not produced by
    # the quantizer, but decodes to +2 in ggml); TQ1_0 digits of 0 and 255 are 0 and 2
    raw = random_raw(T.TQ2_0, 1, 256)
    raw[0, :64] = 0x1B
    _, _, codes, d, _, c = IQUANT_UNPACKERS[int(T.TQ2_0)](raw, 1, 256)
    assert list(codes[0, [0, 32, 64, 96]]) == [3, 2, 1, 0]
    assert np.array_equal(weights((None, 32, codes, d, None, c)), gq.dequantize(raw, T.TQ2_0))


def test_packs():
    # the outputs feed qtypes._pack_codes, and land in an existing kernel family
    for qtype in TYPES:
        raw = random_raw(qtype, 20, 512)
        out = IQUANT_UNPACKERS[int(qtype)](raw, 20, 512)
        pw = _pack_codes(int(qtype), (20, 512), *out)
        assert pw.kind == KINDS[(out[0], out[1])] and pw.d.shape == (2, 512 // out[1], 16)
