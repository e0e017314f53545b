"""CPU weight kernels against gguf.quants' numpy dequantization (the ground truth)."""

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.cpu.matmul import get_rows, matmul
from hearthlm.backends.cpu.qtypes import SUPPORTED_TYPES, PackedWeight, pack_weight
from hearthlm.core.errors import UnsupportedModelError

QUANTIZABLE = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = [T.F32, *QUANTIZABLE, *KQUANTS]
# byte offsets of the float16 scale fields inside a K-quant super-block
KQUANT_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def make_raw(qtype, n_rows, n_cols, rng):
    """Raw GGUF bytes (n_rows, row_bytes), read-only like a memmap."""
    if qtype in KQUANTS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n_rows * n_cols // block, size), dtype=np.uint8)
        for off in KQUANT_F16_FIELDS[qtype]:
            scale = rng.uniform(0.001, 0.02, size=raw.shape[0]).astype(np.float16)
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(n_rows, -1)
    else:
        w = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        raw = w.view(np.uint8) if qtype == T.F32 else quants.quantize(w, qtype).view(np.uint8)
    raw = np.ascontiguousarray(raw.reshape(n_rows, -1))
    raw.flags.writeable = False
    return raw


def nmse(a, b):
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(b.astype(np.float64) ** 2))


def cols_for(qtype):
    # 96 is 3 blocks of 32: not a whole number of the kernels' 64-weight groups
    return (256, 512) if qtype in KQUANTS else (96, 320)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_types_are_supported(qtype):
    assert int(qtype) in SUPPORTED_TYPES


def int8_activations(x):
    """x as the integer kernels see it: int8 codes per 32 columns, scale amax / 127 (ggml's q8_0)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    q = np.rint(b * np.divide(1, d, out=np.zeros_like(d), where=d > 0))
    return (q * d).reshape(x.shape).astype(np.float64)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 7, 67])
def test_matmul_matches_dequantize(qtype, n_rows):
    """Two oracles: the exact product with x quantized as the integer kernels quantize it (the
    kernels' arithmetic, tight), and the float product (the quantization error, over all of a
    shape's outputs: a single output near zero says little about a relative error)."""
    rng = np.random.default_rng(int(qtype) * 100 + n_rows)
    integer = qtype not in (T.F32, T.F16, T.BF16)
    for n_cols in cols_for(qtype):
        raw = make_raw(qtype, n_rows, n_cols, rng)
        ref_w = quants.dequantize(raw, qtype).reshape(n_rows, n_cols)
        w = pack_weight(int(qtype), raw, (n_rows, n_cols))
        assert isinstance(w, PackedWeight)
        assert w.shape == (n_rows, n_cols) and w.ggml_type == int(qtype) and w.nbytes > 0
        ys, refs = [], []
        for n_tok in (1, 2, 3, 4, 8, 17, 24):
            x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
            y = matmul(w, x)
            assert y.shape == (n_tok, n_rows) and y.dtype == np.float32
            if integer:
                exact = int8_activations(x) @ ref_w.T.astype(np.float64)
                err = nmse(y, exact)
                assert err < 1e-9, (qtype.name, n_rows, n_cols, n_tok, err)
            ys.append(y.ravel())
            refs.append((x.astype(np.float64) @ ref_w.T.astype(np.float64)).ravel())
        err = nmse(np.concatenate(ys), np.concatenate(refs))
        assert err < 5e-4, (qtype.name, n_rows, n_cols, err)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.Q3_K], ids=lambda t: t.name)
def test_matmul_many_tiles(qtype, monkeypatch):
    """Enough rows and tokens for several dequantized tiles, the last one partial."""
    from hearthlm.backends.cpu import matmul as mm
    monkeypatch.setattr(mm, "BLAS_MIN_TOKENS", 8)
    rng = np.random.default_rng(7)
    n_rows, n_cols = 601, 256
    raw = make_raw(qtype, n_rows, n_cols, rng)
    ref_w = quants.dequantize(raw, qtype).reshape(n_rows, n_cols)
    w = pack_weight(int(qtype), raw, (n_rows, n_cols))
    for n_tok in (1, 5, 8, 40):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        assert nmse(matmul(w, x), x.astype(np.float64) @ ref_w.T.astype(np.float64)) < 5e-4


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_matches_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    n_rows, n_cols = 67, cols_for(qtype)[0]
    raw = make_raw(qtype, n_rows, n_cols, rng)
    ref_w = quants.dequantize(raw, qtype).reshape(n_rows, n_cols)
    w = pack_weight(int(qtype), raw, (n_rows, n_cols))
    ids = np.array([0, 66, 5, 5, 31], dtype=np.int32)
    out = get_rows(w, ids)
    assert out.shape == (5, n_cols) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref_w[ids], rtol=1e-5, atol=1e-6)
    assert get_rows(w, np.zeros(0, dtype=np.int32)).shape == (0, n_cols)


def test_get_rows_rejects_out_of_range():
    rng = np.random.default_rng(0)
    w = pack_weight(int(T.Q8_0), make_raw(T.Q8_0, 4, 64, rng), (4, 64))
    with pytest.raises(IndexError):
        get_rows(w, np.array([4], dtype=np.int32))


@pytest.mark.parametrize("qtype", [T.NVFP4, T.I8, T.F64])
def test_unsupported_type_raises(qtype):
    raw = np.zeros((2, 64), dtype=np.uint8)
    with pytest.raises(UnsupportedModelError):
        pack_weight(int(qtype), raw, (2, 64))


def test_unknown_type_number_raises():
    with pytest.raises(UnsupportedModelError):
        pack_weight(9999, np.zeros((1, 4), dtype=np.uint8), (1, 1))


def test_matmul_zero_activations():
    rng = np.random.default_rng(1)
    w = pack_weight(int(T.Q4_1), make_raw(T.Q4_1, 9, 128, rng), (9, 128))
    y = matmul(w, np.zeros((2, 128), dtype=np.float32))
    assert np.all(y == 0.0)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_matmul_nan_in_activations_propagates(qtype):
    """A NaN or inf in x must show in y (as the BLAS path and numpy would), not vanish in the int8 cast."""
    rng = np.random.default_rng(2)
    w = pack_weight(int(qtype), make_raw(qtype, 5, 256, rng), (5, 256))
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((2, 256)).astype(np.float32)
        x[1, 40] = bad
        y = matmul(w, x)
        assert np.all(np.isfinite(y[0])) and np.all(np.isnan(y[1]))


def test_half_types_widen_every_bit_pattern():
    """All 65536 F16 and BF16 bit patterns (subnormals, inf, NaN included) widen exactly."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    raw = bits.view(np.uint8)
    f16 = get_rows(pack_weight(int(T.F16), raw, (256, 256)), np.arange(256, dtype=np.int32))
    np.testing.assert_array_equal(f16, bits.view(np.float16).astype(np.float32))
    bf16 = get_rows(pack_weight(int(T.BF16), raw, (256, 256)), np.arange(256, dtype=np.int32))
    np.testing.assert_array_equal(bf16, (bits.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_weights_a_token_a_lane(qtype):
    """From HALF_TOKENS_MIN tokens, F32/F16/BF16 weights multiply a token per vector lane
    (halfs.matmul_tokens): each output is fma over k in order, so it is the float64 product
    to float32 rounding, and a token's row is bitwise the same whatever else shares the call.
    37 rows: full and partial row blocks; 6000 columns: x in several chunks (X_CHUNK_BYTES)."""
    from hearthlm.backends.cpu import halfs
    from hearthlm.backends.cpu import matmul as mm
    rng = np.random.default_rng(int(qtype) + 5)
    for n_rows, n_cols in ((37, 96), (37, 6000)):
        raw = make_raw(qtype, n_rows, n_cols, rng)
        ref_w = quants.dequantize(raw, qtype).reshape(n_rows, n_cols).astype(np.float64)
        w = pack_weight(int(qtype), raw, (n_rows, n_cols))
        x = rng.standard_normal((70, n_cols)).astype(np.float32)
        if n_cols == 6000:
            assert halfs.X_CHUNK_BYTES // (n_cols * halfs.VW * 4) < 70 // halfs.VW  # several chunks
        alone = None
        for n_tok in (mm.HALF_TOKENS_MIN, 9, 16, 17, 33, 70):
            y = matmul(w, x[:n_tok])
            ref = x[:n_tok].astype(np.float64) @ ref_w.T
            scale = np.abs(x[:n_tok]).astype(np.float64) @ np.abs(ref_w).T  # sum |x w|: the rounding's scale
            assert np.all(np.abs(y - ref) <= 1e-6 * n_cols ** 0.5 * scale + 1e-30), (qtype.name, n_tok)
            alone = y[0] if alone is None else alone
            assert np.array_equal(y[0], alone), (qtype.name, n_tok)
        y = matmul(w, x[30:70])  # the same tokens in other lanes and chunks
        np.testing.assert_array_equal(y, matmul(w, x)[30:70])


def test_pack_weight_rejects_mismatched_bytes():
    with pytest.raises(ValueError):
        pack_weight(int(T.Q4_1), np.zeros((4, 40), dtype=np.uint8), (4, 96))  # 96 cols need 60 bytes
    with pytest.raises(ValueError):
        pack_weight(int(T.Q4_K), np.zeros((1, 144), dtype=np.uint8), (1, 128))  # not whole 256-blocks


@pytest.mark.parametrize("qtype", [*QUANTIZABLE[2:], *KQUANTS], ids=lambda t: t.name)
def test_matmul_is_batch_invariant(qtype):
    """A token's row of y is bitwise the same whatever else shares the call (batched decode must
    give a request the tokens it gets alone): the one-token fast path and the batched call
    combine the exact sub-block sums with the same float operations in the same order, and 37
    rows cover both the 16-row vector path and the scalar rows of a partial block."""
    from hearthlm.backends.cpu import matmul as mm
    rng = np.random.default_rng(int(qtype) + 11)
    n_rows, n_cols = 37, cols_for(qtype)[1]
    w = pack_weight(int(qtype), make_raw(qtype, n_rows, n_cols, rng), (n_rows, n_cols))
    x = rng.standard_normal((40, n_cols)).astype(np.float32)
    x[:, ::7] *= 30.0  # uneven magnitudes: activation scales differ per block
    ref = matmul(w, x[:1])  # token 0 alone
    batches = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 33, mm.BLAS_MIN_TOKENS - 1]
    for n_tok in batches:
        if n_tok >= mm.BLAS_MIN_TOKENS or n_tok > x.shape[0]:
            continue
        for start in (0, 3):  # overlapping token sets, the token at a different position
            idx = np.r_[0, np.arange(start + 1, start + n_tok)]
            y = matmul(w, x[idx])
            assert np.array_equal(y[0], ref[0]), (qtype.name, n_tok, start)
            y_alone = np.concatenate([matmul(w, x[i:i + 1]) for i in idx[:4]])
            assert np.array_equal(y[:4], y_alone[:len(idx[:4])]), (qtype.name, n_tok, start)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_several_tokens_into_a_buffer_as_the_quantize_then_multiply_path(qtype):
    """Several tokens into a planned buffer (matmul with out, matmul_add with out, whole ffn_glu:
    one recorded compiled call each, what replay.py replays): bitwise the results of quantize_x,
    then the kernels, then the sums and the GLU in numpy, at 2-24 tokens; matmul_add writing into
    its residual's own buffer (memory.INPLACE) too. Mutations seen to fail: _matmul_add_n adding
    the residual's first row to every row; ffn_glu_n taking the gate's products for the up's."""
    from hearthlm.backends.cpu import ops
    from hearthlm.backends.cpu.ffn import ffn_glu
    from hearthlm.backends.cpu.matmul import _matmul_int, matmul_add, quantize_for
    rng = np.random.default_rng(int(qtype) + 5)
    n_rows, n_cols = 37, cols_for(qtype)[1]
    w, wu = (pack_weight(int(qtype), make_raw(qtype, n_rows, n_cols, rng), (n_rows, n_cols)) for _ in range(2))
    for n_tok in (2, 3, 4, 9, 16, 24):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        x[:, ::5] *= 20.0
        want = _matmul_int(w, n_tok, quantize_for(w, x)[1])
        got = np.full((n_tok, n_rows), np.nan, np.float32)
        assert matmul(w, x, got) is got and np.array_equal(got, want), n_tok
        r = rng.standard_normal((n_tok, n_rows)).astype(np.float32)
        plus = np.full_like(r, np.nan)
        matmul_add(w, x, r, plus)
        assert np.array_equal(plus, want + r), n_tok
        matmul_add(w, x, r, r)  # in place
        assert np.array_equal(r, plus), n_tok
        for gelu in (False, True):
            g, u = want.copy(), _matmul_int(wu, n_tok, quantize_for(wu, x)[1])
            ops.glu(g, u, gelu, g)
            out = np.full((n_tok, n_rows), np.nan, np.float32)
            ffn_glu(w, wu, x, gelu, out)
            assert np.array_equal(out, g), (n_tok, gelu)


# byte ranges of a block that hold the weights' codes (low bits and high-bit planes), per type
CODE_BYTES = {T.Q4_0: (2, 18), T.Q4_1: (4, 20), T.Q5_0: (2, 22), T.Q5_1: (4, 24), T.Q2_K: (16, 80),
              T.Q3_K: (0, 96), T.Q4_K: (16, 144), T.Q5_K: (16, 176), T.Q6_K: (0, 192)}


@pytest.mark.parametrize("qtype", list(CODE_BYTES), ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1, -1])
def test_largest_codes_and_activations_do_not_overflow(qtype, sign):
    """Every code at its largest (all bits set; Q6_K's at -32, all clear) against activations that
    all quantize to +-127: the largest integer sums there are. Without AVX-512, 4-, 5- and 6-bit codes
    add vpmaddubsw's int16 pair sums as int16 up to dot._ACC16 times before widening (8 * 2 * 15 * 127,
    4 * 2 * 31 * 127 and 4 * 2 * 32 * 127 stay below 2**15). Exact against the float64 product of the same integers, at token counts that
    take every token group (1, 2, 4, 8 and their tails). Mutation seen to fail on this AVX2 host: the
    5-bit codes' limit raised from 4 to 8 (Q5_0, Q5_1, Q5_K wrap, both signs); Q6_K's activations
    taken without their signs flipped to match the codes' (Q6_K, both signs). (Q6_K's limit of 4 is
    also its sub-block's length, 16 weights, so raising it changes nothing.) On AVX-512 hosts the
    same sums go through vpdpbusd's int32 (no limit to break there)."""
    rng = np.random.default_rng(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    n_rows, n_cols = 37, cols_for(qtype)[1]
    raw = np.array(make_raw(qtype, n_rows, n_cols, rng)).reshape(-1, size)
    lo, hi = CODE_BYTES[qtype]
    raw[:, lo:hi] = 0 if qtype == T.Q6_K else 0xFF
    raw = raw.reshape(n_rows, -1)
    ref_w = quants.dequantize(raw, qtype).reshape(n_rows, n_cols).astype(np.float64)
    w = pack_weight(int(qtype), raw, (n_rows, n_cols))
    for n_tok in (1, 2, 4, 7, 8, 16):
        x = np.full((n_tok, n_cols), 3.0 * sign, np.float32)
        exact = int8_activations(x) @ ref_w.T
        assert nmse(matmul(w, x), exact) < 1e-9, (qtype.name, n_tok)


# bits a weight of the packed K-quants (codes, sc and mins per sub-block, D and Dmin per 256; qtypes):
# Q2_K/Q3_K's codes go in 4-bit nibbles
KQUANT_MAX_BITS = {T.Q2_K: 5.2, T.Q3_K: 4.7, T.Q4_K: 4.7, T.Q5_K: 5.7, T.Q6_K: 6.7}


def float32_scales(w):
    """w with the float32 d and m its K-quant scales stand for (D * sc, -Dmin * mn): the layout
    before the split, which the kernels also read (IQ types keep it)."""
    import dataclasses
    per = 256 // w.sub  # sub-blocks per super-block
    sup = np.repeat(w.sup.view(np.float16).astype(np.float32), per, axis=1)  # (blocks, sub-blocks, planes, 16)
    d = sup[:, :, 0] * w.d.astype(np.float32)
    m = sup[:, :, 1] * w.m.astype(np.float32) if w.ms else w.m
    return dataclasses.replace(w, d=d, m=m, sup=None)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_kquant_scales_are_compact_and_exact(qtype, monkeypatch):
    """K-quants keep the file's small integer scales beside float16 super-block ones, and every
    path (vector groups and scalar tail rows, 1..17 tokens, matmul_add, BLAS tiles, get_rows, the
    weight cache's export/import) gives bitwise what float32 scales D * sc give."""
    from hearthlm.backends.cpu import matmul as mm
    from hearthlm.backends.cpu.backend import CPUBackend
    rng = np.random.default_rng(int(qtype) + 23)
    big = pack_weight(int(qtype), make_raw(qtype, 64, 1024, rng), (64, 1024))
    assert big.split and big.nbytes * 8 / big.d.size / big.sub <= KQUANT_MAX_BITS[qtype], big.nbytes
    n_rows, n_cols = 37, 512  # two whole blocks of 16 rows, then 5 scalar ones
    w = pack_weight(int(qtype), make_raw(qtype, n_rows, n_cols, rng), (n_rows, n_cols))
    ref = float32_scales(w)
    assert not ref.split and ref.nbytes > w.nbytes
    same = lambda a, b: np.array_equal(a.view(np.uint32), b.view(np.uint32))  # noqa: E731
    for n_tok in (1, 2, 3, 4, 5, 8, 17):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        assert same(matmul(w, x), matmul(ref, x)), n_tok
        r = rng.standard_normal((n_tok, n_rows)).astype(np.float32)
        assert same(mm.matmul_add(w, x, r), mm.matmul_add(ref, x, r)), n_tok
    ids = np.arange(n_rows, dtype=np.int32)
    assert same(get_rows(w, ids), get_rows(ref, ids))
    backend = CPUBackend()
    back = backend.import_weight(*backend.export_weight(w))
    assert all(np.array_equal(getattr(back, f), getattr(w, f)) for f in ("qs", "d", "m", "sup"))
    x = rng.standard_normal((9, n_cols)).astype(np.float32)
    monkeypatch.setattr(mm, "BLAS_MIN_TOKENS", 8)
    assert same(matmul(w, x), matmul(ref, x))


def test_q6_k_in_six_bits_gives_the_int8_layouts_results(monkeypatch):
    """Q6_K's codes packed in 6 bits ("nib6": nibbles and 2-bit planes, unpacked in registers) enter
    the sums as the int8 layout's do: bitwise the results of the same codes packed as "i8"."""
    from hearthlm.backends.cpu import matmul as mm
    from hearthlm.backends.cpu.kquants import KQUANT_UNPACKERS
    from hearthlm.backends.cpu.qtypes import _pack_codes
    rng = np.random.default_rng(61)
    n_rows, n_cols = 37, 512
    raw = make_raw(T.Q6_K, n_rows, n_cols, rng)
    layout, sub, codes, d, m, c = KQUANT_UNPACKERS[int(T.Q6_K)](raw, n_rows, n_cols)
    assert layout == "nib6" and codes.max() <= 63
    w = pack_weight(int(T.Q6_K), raw, (n_rows, n_cols))
    ref = _pack_codes(int(T.Q6_K), (n_rows, n_cols), "i8", sub, (codes.astype(np.int16) - 32).astype(np.int8), d, m, c)
    assert w.qs.shape[-1] == 48 and ref.qs.shape[-1] == 64
    same = lambda a, b: np.array_equal(a.view(np.uint32), b.view(np.uint32))  # noqa: E731
    for n_tok in (1, 2, 3, 4, 5, 8, 17):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        assert same(matmul(w, x), matmul(ref, x)), n_tok
    ids = np.arange(n_rows, dtype=np.int32)
    assert same(get_rows(w, ids), get_rows(ref, ids))
    monkeypatch.setattr(mm, "BLAS_MIN_TOKENS", 8)
    assert same(matmul(w, x), matmul(ref, x))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_packing_in_slices_equals_packing_whole(qtype, monkeypatch):
    """Big weights are unpacked PACK_ROWS rows at a time into the final arrays: the same bytes
    as one pass, for a row count that leaves a partial last slice and a partial last block."""
    from hearthlm.backends.cpu import qtypes
    rng = np.random.default_rng(int(qtype) + 5)
    n_rows, n_cols = 77, cols_for(qtype)[1]
    raw = make_raw(qtype, n_rows, n_cols, rng)
    whole = pack_weight(int(qtype), raw, (n_rows, n_cols))
    monkeypatch.setattr(qtypes, "PACK_ROWS", 32)
    sliced = pack_weight(int(qtype), raw, (n_rows, n_cols))
    for f in ("qs", "d", "m", "sup"):
        assert np.array_equal(getattr(whole, f), getattr(sliced, f)), f
    assert sliced.shape == whole.shape and sliced.ms == whole.ms


def test_one_token_matmul_first_in_a_fresh_process():
    """The one-token drivers reach numba's parallel kernels from inside compiled code, which
    needs numba's thread pool started first: a process whose first kernel is one of them
    crashed (segfault) before matmul.py started the pool at import."""
    import subprocess
    import sys
    code = ("import numpy as np\n"
            "from gguf.constants import GGMLQuantizationType as T\n"
            "from hearthlm.backends.cpu.bench_kernels import random_raw\n"
            "from hearthlm.backends.cpu.qtypes import pack_weight\n"
            "from hearthlm.backends.cpu.matmul import matmul\n"
            "w = pack_weight(int(T.Q4_1), random_raw(T.Q4_1, 64, 576, np.random.default_rng(0)), (64, 576))\n"
            "print(float(matmul(w, np.ones((1, 576), np.float32)).sum()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert np.isfinite(float(r.stdout.strip()))


# haswell (AVX2 and F16C, no AVX-512) and skylake-avx512 (no VNNI: ~46 s of compiling) are `make test-long`'s,
# and run natively on such hosts; generic lacks both F16C and AVX-512: in the suite a 4-bit family with
# float16 scales, an int8 one and F16 (~50 s of compiling), every family in `make test-long` (~100 s)
_PORTABLE_TYPES = ("Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q8_0", "F16")


@pytest.mark.parametrize("target,types", [
    ("generic", ("Q4_1", "Q8_0", "F16")), pytest.param("generic", _PORTABLE_TYPES, marks=pytest.mark.long),
    pytest.param("haswell", _PORTABLE_TYPES, marks=pytest.mark.long),
    pytest.param("skylake-avx512", _PORTABLE_TYPES, marks=pytest.mark.long)],
    ids=["generic", "generic-all", "haswell", "skylake-avx512"])
def test_portable_target_without_avx512_or_f16c(target, types):
    """NUMBA_CPU_NAME=generic compiles for baseline x86-64 (as for caches that travel): the
    kernels must then skip the AVX-512 intrinsics and widen float16 scales with integer
    arithmetic (LLVM's own conversion would call compiler-rt, absent from numba's JIT); a
    Haswell target has AVX2 only (vpmaddubsw and pmaddwd on 256-bit halves); a Skylake-X one has
    AVX-512BW but no VNNI: pmaddwd stands in for vpdpbusd. Checked in a
    fresh process: every float16 bit pattern, and matmuls of a 4-bit family
    with float16 scales, an int8 one and a K-quant's split scales (Q4_K, Q6_K) against dequantization."""
    if target == "skylake-avx512" and "avx512bw" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU cannot run AVX-512BW code")
    import os
    import subprocess
    import sys
    code = """
import numba, numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T
from hearthlm.backends.cpu import dot, halfs
from hearthlm.backends.cpu.bench_kernels import random_raw
from hearthlm.backends.cpu.matmul import matmul
from hearthlm.backends.cpu.qtypes import pack_weight
import sys
if sys.argv[1] == "generic":
    assert not halfs.NATIVE_HALF and not dot._HAS_BW
elif sys.argv[1] == "haswell":  # AVX2: vpmaddubsw for 4- and 5-bit codes, pmaddwd for int8 ones
    assert halfs.NATIVE_HALF and dot._HAS_AVX2 and not dot._HAS_BW
else:
    assert halfs.NATIVE_HALF and dot._HAS_BW and not dot._HAS_VNNI
@numba.njit
def widen_all(h, out):
    for i in range(h.shape[0]):
        out[i] = halfs.f32(h[i])
h = np.arange(65536, dtype=np.uint16); out = np.empty(65536, np.float32); widen_all(h, out)
ref = h.view(np.float16).astype(np.float32)
assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.array_equal(out[~np.isnan(ref)], ref[~np.isnan(ref)])
rng = np.random.default_rng(0)
for qt in (T[name] for name in sys.argv[2].split(",")):
    raw = random_raw(qt, 37, 512, rng)
    w = pack_weight(int(qt), raw, (37, 512))
    for n in (1, 3, 6, 20):  # 20: the float types' token-a-lane kernel (8-wide vectors without AVX-512)
        x = rng.standard_normal((n, 512)).astype(np.float32)
        r = x @ quants.dequantize(raw, qt).reshape(37, 512).T
        err = float(((matmul(w, x) - r) ** 2).sum() / (r ** 2).sum())
        assert err < 5e-4, (qt.name, n, err)
print("ok")
"""
    # the machine's kernel cache (conftest): numba keys each entry by CPU name and features, so the
    # target's kernels sit beside the host's; compiled at the first run of these sources, loaded after
    env = dict(os.environ, NUMBA_CPU_NAME=target)
    if target == "haswell":
        env["NUMBA_CPU_FEATURES"] = "+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2"
    elif target != "generic":
        env["NUMBA_CPU_FEATURES"] = "+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512dq,-avx512vnni"
    r = subprocess.run([sys.executable, "-c", code, target, ",".join(types)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_kernel_paths_follow_the_features_numba_compiles_with():
    """NUMBA_CPU_NAME alone leaves numba compiling with the host's features: the kernels' choice
    of intrinsics must follow them (halfs.TARGET_FEATURES), not fall to the generic ones. With
    NUMBA_CPU_FEATURES too, the features given. Mutation: the old rule (a named CPU without
    features meant none) picks the generic paths on an AVX-512BW host and fails the first case."""
    import os
    import subprocess
    import sys

    import llvmlite.binding as llb
    code = "from hearthlm.backends.cpu import dot; print(dot._HAS_BW, dot._HAS_AVX2)"

    def paths(**env):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in dict(os.environ, **env).items() if v is not None})
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()
    host = llb.get_host_cpu_features().flatten()
    assert paths(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=None) == [str("+avx512bw" in host), str("+avx2" in host)]
    assert paths(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="+avx,+avx2,+fma,+f16c") == ["False", "True"]
    assert paths(NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=None) == ["False", "False"]


@pytest.mark.parametrize("n_tok", [1, 3])
def test_matmul_add_in_place_over_the_residual(n_tok):
    """MUL_MAT_ADD may write over its residual (memory.INPLACE): the one-token driver must read
    the residual before the product lands in the same buffer."""
    from hearthlm.backends.cpu.matmul import matmul_add
    rng = np.random.default_rng(3)
    n_rows, n_cols = 40, 128
    w = pack_weight(int(T.Q4_1), make_raw(T.Q4_1, n_rows, n_cols, rng), (n_rows, n_cols))
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    r = rng.standard_normal((n_tok, n_rows)).astype(np.float32)
    expect = matmul(w, x) + r
    assert np.array_equal(matmul_add(w, x, r.copy()), expect)
    buf = r.copy()
    assert matmul_add(w, x, buf, out=buf) is buf
    assert np.array_equal(buf, expect)


def test_mul_mat_id_reads_only_selected_experts():
    """The CPU groups tokens per expert and reads only the selected experts' weights."""
    from hearthlm.backends.cpu.backend import CPUBackend, Experts
    from hearthlm.core.graph import Graph
    from hearthlm.core.weights import QWeight
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 8, 32)).astype(np.float32)
    used = {e: pack_weight(int(T.F32), w[e].view(np.uint8), (8, 32)) for e in (0, 2)}
    experts = Experts(used.get(e) for e in range(3))  # expert 1 absent: reading it would fail
    g = Graph()
    node = g.mul_mat_id(g.weight(QWeight("e", int(T.F32), (3, 8, 32), np.zeros((24, 128), np.uint8))),
                        g.input("x", (2, 32), np.float32), g.input("ids", (2, 1)), "y")
    x, ids = rng.standard_normal((2, 32)).astype(np.float32), np.array([[2], [0]], np.int32)
    y = CPUBackend().kernels[node.op](node, experts, x, ids)
    assert np.allclose(y[:, 0], np.stack([x[0] @ w[2].T, x[1] @ w[0].T]), atol=1e-4)


@pytest.mark.parametrize("into", [0, 2])
def test_add_n_into_any_source(into):
    """The planner may give add_n any source's buffer (Op.ADD_N's inplace): the sum stays right."""
    from hearthlm.backends.cpu.backend import CPUBackend
    from hearthlm.core.graph import Graph, Op
    rng = np.random.default_rng(into)
    xs = [rng.standard_normal((3, 40)).astype(np.float32) for _ in range(3)]
    want = xs[0] + xs[1] + xs[2]
    g = Graph()
    node = g.add_n([g.input(f"x{i}", (3, 40), np.float32) for i in range(3)], "s")
    got = CPUBackend().kernels[Op.ADD_N](node, *xs, out=xs[into])
    assert np.allclose(got, want, atol=1e-6)


def test_norm_of_zeros_without_epsilon_gives_nan_not_an_exception():
    """Garbage weights (a zero row, a zero epsilon) make NaN, as numpy and ggml do: a Python
    ZeroDivisionError out of a kernel used to end the step."""
    from hearthlm.backends.cpu import ops
    x = np.zeros((3, 8), np.float32)
    out = np.empty_like(x)
    for kernel in (ops.rms_norm, ops.rms_norm_1):
        kernel(x, np.ones(8, np.float32), 0.0, out)
        assert np.isnan(out).all()
    with np.errstate(all="ignore"):
        want = x / np.sqrt((x * x).mean(axis=1, keepdims=True))
    ops.rms_norm_add(x, np.ones(8, np.float32), np.ones_like(x), 0.0, out)
    assert np.isnan(out).all() and np.isnan(want).all()


@pytest.mark.parametrize("n_tok", [1, 3, 4, 17])
@pytest.mark.parametrize("weighted", [True, False])
def test_head_norms_of_a_strided_slice_are_the_contiguous_rows_norms(n_tok, weighted):
    """Gemma's q and k norms of several tokens take (tokens, heads, d) as the strided column
    slice of the fused QKV product it is (ops.rms_norm_heads: no contiguous copy, so replay can
    record the step): bitwise the 2-D kernels' result on the contiguous rows, the input left as
    it was. Mutations seen to fail: the serial variant's tokens taken in reverse order; the parallel
    variant's rows taken from token 0."""
    from types import SimpleNamespace

    from hearthlm.backends.cpu import ops
    from hearthlm.backends.cpu.backend import _bind_rms_norm
    rng = np.random.default_rng(n_tok)
    n_head, d = 4, 256
    fused = (rng.standard_normal((n_tok, 2 * n_head * d + 64)) * 3).astype(np.float32)
    x = fused[:, 64:64 + n_head * d].reshape(n_tok, n_head, d)  # a view, strided for several tokens
    assert n_tok == 1 or not x.flags.c_contiguous
    w = rng.standard_normal(d).astype(np.float32) if weighted else None
    before = fused.copy()
    norm = _bind_rms_norm(SimpleNamespace(params={"eps": 1e-6}, shape=x.shape))
    got = norm(x, w, out=np.empty(x.shape, np.float32))
    want = np.empty((n_tok * n_head, d), np.float32)
    for kernel in (ops.rms_norm, ops.rms_norm_1):
        kernel(np.ascontiguousarray(x).reshape(-1, d), np.zeros(0, np.float32) if w is None else w, 1e-6, want)
        assert got.tobytes() == want.tobytes()
    assert fused.tobytes() == before.tobytes()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("per_slot", [False, True])
def test_one_token_experts_in_one_call_match_the_grouped_path(qtype, per_slot):
    """MUL_MAT_ID for one token (decode) runs its k experts in one compiled call: bitwise what
    the grouped path (a matmul per selected expert) gives."""
    from hearthlm.backends.cpu.backend import Experts, _mul_mat_id
    rng = np.random.default_rng(int(qtype))
    rows, cols, n_exp, k = 40, 256, 6, 3
    experts = Experts(pack_weight(int(qtype), make_raw(qtype, rows, cols, rng), (rows, cols)) for _ in range(n_exp))
    x = rng.standard_normal((1, k, cols) if per_slot else (1, cols)).astype(np.float32)
    ids = np.array([[4, 0, 5]], np.int32)

    class Node:
        shape = (1, k, rows)
    fast = _mul_mat_id(Node, experts, x, ids, out=np.empty((1, k, rows), np.float32))
    assert experts.lists  # the compiled path ran
    experts.lists = False  # the grouped path
    slow = _mul_mat_id(Node, experts, x, ids, out=np.empty((1, k, rows), np.float32))
    assert np.array_equal(fast, slow)
    xs = x[0] if per_slot else np.repeat(x, k, axis=0)
    assert np.allclose(fast[0], np.stack([matmul(experts[e], xs[j:j + 1])[0] for j, e in enumerate(ids[0])]))


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_numpys_argmax(threads, monkeypatch):
    """The CPU backend's greedy ids (rows split over two threads where there are many values)
    are numpy's argmax row by row: the first of equal maxima, the first NaN before any number,
    an odd row count's last row included. Mutations seen to fail: the second half's result
    dropped (np.concatenate of the first alone), the halves joined in the wrong order."""
    import numba

    from hearthlm.backends.cpu import backend as cpu
    monkeypatch.setattr(cpu, "ARGMAX_SPLIT", 1000)
    x = np.random.default_rng(5).standard_normal((7, 4096)).astype(np.float32)
    x[1, [10, 3000]] = 9.0  # a tie: the first wins
    x[2, [50, 4000]] = np.nan  # NaNs: the first wins, over any number
    x[5, :] = 0.0
    old = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = cpu.CPUBackend().argmax_rows(x)
    finally:
        numba.set_num_threads(old)
    assert got.tolist() == x.argmax(axis=1).tolist()
    assert got[1] == 10 and got[2] == 50 and got[5] == 0
