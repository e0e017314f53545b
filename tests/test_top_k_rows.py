"""Each row's k largest logits taken where the logits are (Backend.top_k_rows): the CPU
backend's numba kernel (backends/cpu/topk.py) and core.array_ops.top_k_rows (the default, and
what the CUDA backend runs with cupy) against runtime.sampling.top_k_ids row by row, and
sampling from those candidates (sampling.sample_top_k) against sample() on the whole row."""
import numpy as np
import pytest

from hearthlm.backends.cpu.backend import CPUBackend
from hearthlm.core import array_ops
from hearthlm.core.backend import Backend
from hearthlm.runtime.sampling import SamplingParams, sample, sample_top_k, top_k_ids

SPECIALS = np.array([0.0, -0.0, 1.0, -np.inf, np.inf], np.float32)


def _rows(rng, trial: int):
    """Rows of a kind per trial: plain, heavy ties, signed zeros and infinities, all equal, a
    NaN, one finite entry among -infs; widths around the kernel's 64-entry blocks."""
    n, v = int(rng.integers(1, 9)), int(rng.choice([2, 3, 5, 63, 64, 65, 200, 1000, 5000, 30000]))
    kind = trial % 6
    if kind == 0:
        x = rng.standard_normal((n, v)).astype(np.float32)
    elif kind == 1:
        x = rng.integers(-3, 3, (n, v)).astype(np.float32)
    elif kind == 2:
        x = rng.choice(SPECIALS, (n, v))
    elif kind == 3:
        x = np.zeros((n, v), np.float32)
    elif kind == 4:
        x = rng.standard_normal((n, v)).astype(np.float32)
        x[rng.integers(0, n), rng.integers(0, v)] = np.nan
    else:
        x = np.full((n, v), -np.inf, np.float32)
        x[:, rng.integers(0, v)] = 1.0
    return x, rng.integers(0, min(v, 300), n)


IMPLS = {"cpu numba": lambda x, ks: CPUBackend().top_k_rows(x, ks),
         "array_ops numpy": lambda x, ks: array_ops.top_k_rows(x, ks, np),
         "Backend default": lambda x, ks: Backend().top_k_rows(x, ks)}


@pytest.mark.parametrize("impl", IMPLS)
def test_top_k_rows_are_top_k_ids(impl):
    """Row by row: the first k ids are top_k_ids's (ascending, the lowest ids among entries equal
    to the k-th), the values are the row's at them bit for bit, ok is False exactly where a
    sampled row has a NaN, k 1 is np.argmax (a NaN's first), k 0 rows are skipped. Mutations
    seen to fail (numba kernel): the ties' quota not kept (every entry equal to the k-th
    taken), the blocks' threshold taken at the (k-1)-th largest block maximum
    (a block of the k largest missed), -0.0's key left at -1 (a block of -0.0 skipped beside
    a 0.0 threshold), the NaN check dropped, k 1 taking the last block of equal maxima or the
    last NaN; (array_ops) the ties' quota compared with < (one equal entry short)."""
    rng = np.random.default_rng(5)
    run = IMPLS[impl]
    zeros = np.full((2, 256), -np.inf, np.float32)  # -0.0 first, then 0.0, then 1.0, a block (64) apart
    zeros[:, [5, 70, 140]] = [-0.0, 0.0, 1.0]
    nans = rng.standard_normal((2, 500)).astype(np.float32)
    nans[:, [10, 300]] = np.nan  # two NaNs: argmax is the first, a sampled row is not ok
    special = [(zeros, np.array([2, 3])), (nans, np.array([1, 5]))]
    for trial in range(240 + len(special)):
        x, ks = _rows(rng, trial) if trial < 240 else special[trial - 240]
        ids, vals, ok = run(x, ks)
        assert ids.shape == vals.shape == (len(ks), max(int(ks.max()), 1)) and ok.shape == (len(ks),)
        for i, k in enumerate(ks.tolist()):
            if k == 0:
                continue
            if k == 1:
                assert ok[i] and ids[i, 0] == np.argmax(x[i]), (trial, i)
                continue
            if np.isnan(x[i]).any():
                assert not ok[i], (trial, i)
                continue
            want = top_k_ids(x[i], k)
            assert ok[i] and ids[i, :k].tolist() == want.tolist(), (trial, i, k)
            assert (vals[i, :k].view(np.int32) == x[i, want].view(np.int32)).all(), (trial, i)


def test_top_k_rows_over_a_vocabulary_at_one_and_two_threads(monkeypatch):
    """A Qwen-sized vocabulary (151,936), where the kernel's blocks matter, and the rows spread
    over two threads: the same ids as top_k_ids for k 2-1024. Mutation seen to fail: each row
    written to the next row's place (ids[i + 1])."""
    import numba
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((6, 151936)) * 3).astype(np.float32)
    x[3, 1000:1100] = x[3].max()  # a tie at the top, across two blocks
    ks = np.array([40, 2, 1024, 100, 7, 300])
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        ids, vals, ok = CPUBackend().top_k_rows(x, ks)
        assert ok.all()
        for i, k in enumerate(ks.tolist()):
            assert ids[i, :k].tolist() == top_k_ids(x[i], k).tolist(), (threads, i)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_sampling_from_the_candidates_is_sample():
    """sample_top_k on a row's top_k candidates draws the token sample() draws from the row, and
    leaves the generator in the same state; a NaN row fails as sample() does. Mutations seen to
    fail: the candidates taken in reverse (ties to the highest id), a NaN row sampled from its
    candidates."""
    rng = np.random.default_rng(9)
    for trial in range(200):
        v = int(rng.choice([50, 1000, 30000]))
        x = (rng.standard_normal(v) * rng.choice([0.5, 3.0, 20.0])).astype(np.float32)
        if trial % 5 == 0:
            x = np.round(x)  # ties
        p = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.5])), top_k=int(rng.integers(2, 49)),
                           top_p=float(rng.choice([0.5, 0.95, 1.0])), min_p=float(rng.choice([0.0, 0.05, 0.2])))
        ids, vals, ok = CPUBackend().top_k_rows(x[None], np.array([p.top_k]))
        a, b = np.random.default_rng(trial), np.random.default_rng(trial)
        want = sample(x, p, a, ())
        assert sample_top_k(ids[0, :p.top_k], vals[0, :p.top_k], bool(ok[0]), p, b) == want, trial
        assert a.random() == b.random()
    x[7] = np.nan
    ids, vals, ok = CPUBackend().top_k_rows(x[None], np.array([p.top_k]))
    with pytest.raises(ValueError) as want:
        sample(x, p, np.random.default_rng(0), ())
    with pytest.raises(ValueError) as got:
        sample_top_k(ids[0, :p.top_k], vals[0, :p.top_k], bool(ok[0]), p, np.random.default_rng(0))
    assert str(got.value) == str(want.value)
