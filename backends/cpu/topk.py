"""Each row's k largest logits, for sampling where the logits are (Backend.top_k_rows): the
same candidates as runtime.sampling.top_k_ids, rows spread over the threads."""
import numba
import numpy as np

BLOCK = 64  # entries a block maximum covers
_ABS, _MIN = np.int32(0x7FFFFFFF), np.int32(-(1 << 31))  # int32 constants: an int64 one widens the loop


@numba.njit(cache=True, nogil=True)
def _has_nan(x):
    bad = False
    for i in range(x.shape[0]):
        bad |= x[i] != x[i]
    return bad


@numba.njit(cache=True, nogil=True)
def _block_keys(x, out):
    """Each BLOCK entries' largest float (no NaNs) as an int32 in the floats' order: the bits
    with the negatives' magnitude bits flipped (a float max did not vectorize, an integer one
    does). -0.0's key, -1, is taken as 0.0's."""
    xi = x.view(np.int32)
    n = x.shape[0]
    nf = n // BLOCK
    for b in range(nf):
        xb = xi[b * BLOCK:b * BLOCK + BLOCK]
        m = _MIN
        for i in range(BLOCK):
            v = xb[i]
            m = max(m, v ^ ((v >> np.int32(31)) & _ABS))
        out[b] = m
    if nf < out.shape[0]:
        m = _MIN
        for v in xi[nf * BLOCK:]:
            m = max(m, v ^ ((v >> np.int32(31)) & _ABS))
        out[nf] = m
    for b in range(out.shape[0]):
        out[b] = max(out[b], np.int32(0)) if out[b] == -1 else out[b]


@numba.njit(cache=True, nogil=True)
def _float_of(key):
    a = np.empty(1, np.int32)
    a[0] = key ^ ((key >> np.int32(31)) & _ABS)
    return a.view(np.float32)[0]


@numba.njit(cache=True, nogil=True)
def _top_k_row(x, k, ids, vals):
    """x's k largest entries' ids, ascending, into ids[:k] (their values into vals[:k]); among
    entries equal to the k-th largest, the lowest ids (top_k_ids). False where x has a NaN (then
    nothing is written). k = 1: np.argmax's id, a NaN's included."""
    n = x.shape[0]
    nan = _has_nan(x)
    if nan and k > 1:
        return False
    if nan:  # np.argmax's: the first NaN
        for i in range(n):
            if x[i] != x[i]:
                ids[0], vals[0] = i, x[i]
                return True
    nb = -(-n // BLOCK)
    bmax = np.empty(nb, np.int32)
    _block_keys(x, bmax)
    if k == 1:  # the first entry equal to the largest block maximum (numba's np.argmax is scalar: ~5x slower)
        b = np.argmax(bmax)
        t = _float_of(bmax[b])
        for i in range(b * BLOCK, min(b * BLOCK + BLOCK, n)):
            if x[i] == t:
                ids[0], vals[0] = i, x[i]
                return True
    # the k-th largest block maximum: at least k entries reach it (those k blocks' maxima), so
    # the k largest do, and they lie in the blocks whose maximum reaches it (commonly k blocks)
    if nb > k:
        thr = np.partition(bmax.copy(), nb - k)[nb - k]
    else:  # every entry
        thr = bmax.min()
        for b in range(nb):
            bmax[b] = thr
    reach = 0
    for b in range(nb):
        reach += bmax[b] >= thr
    cand = np.empty(reach * BLOCK, np.int64)
    t = _float_of(thr) if nb > k else -np.inf
    c = 0
    for b in range(nb):
        if bmax[b] >= thr:
            for i in range(b * BLOCK, min(b * BLOCK + BLOCK, n)):
                if x[i] >= t:
                    cand[c] = i
                    c += 1
    v = np.empty(c, x.dtype)
    for j in range(c):
        v[j] = x[cand[j]]
    kth = np.partition(v.copy(), c - k)[c - k]
    above = 0
    for j in range(c):
        above += v[j] > kth
    quota = k - above  # entries equal to the k-th largest to take, lowest ids first
    o = 0
    for j in range(c):
        if v[j] > kth or (v[j] == kth and quota > 0):
            if v[j] == kth:
                quota -= 1
            ids[o], vals[o] = cand[j], v[j]
            o += 1
    return True


@numba.njit(cache=True, nogil=True, parallel=True)
def top_k_rows(x, ks, ids, vals, ok):
    """Row i's ks[i] largest (ks[i] = 0: skipped) into ids[i], vals[i]; ok[i] False where the row has a NaN."""
    for i in numba.prange(x.shape[0]):
        if ks[i] > 0:
            ok[i] = _top_k_row(x[i], ks[i], ids[i], vals[i])
