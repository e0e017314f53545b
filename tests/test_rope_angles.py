"""The CPU RoPE's angle table (backends/cpu/ops._rope_angles, backend._angles): a step's layers
share the first layer's cos and sin per RoPE kind and thread; a row is remade whenever its token's
positions change. The values must be the ones computed in place, bit for bit, whatever the table
held before."""
from __future__ import annotations

import threading

import numpy as np

from hearthlm.backends.cpu import backend as cpu_backend
from hearthlm.backends.cpu import ops

ARGS = (64, 10000.0, 1.0, True, np.zeros(0, np.float64), 1.0, np.zeros(0, np.int64))  # n_rot 64, plain RoPE


def _rope(x, pos, args, table=None):
    out = np.empty_like(x)
    ops.rope(x, pos, *args, out, *(table or ops.rope_table(x.shape[0], args[0], pos.shape[1])))
    return out


def test_a_reused_table_gives_the_fresh_tables_bits():
    """Positions that change between calls (a decode step after another, a shorter batch) remake
    their rows; positions that stay read the cached ones. Mutation: `_rope_angles` reusing a row
    once it was made, without comparing its positions, fails it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    table = ops.rope_table(8, 64, 1)
    for pos in ([3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 9], [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15]):
        p = np.array(pos, np.int32)[:, None]
        np.testing.assert_array_equal(_rope(x, p, ARGS, table), _rope(x, p, ARGS))
    # the angles themselves: cos/sin of pos * base^(-2i/n_rot), to float32
    th = 15 * 10000.0 ** (-2.0 * np.arange(32) / 64)
    np.testing.assert_allclose(table[0][5, :, 0], np.cos(th), rtol=1e-6)
    np.testing.assert_allclose(table[0][5, :, 1], np.sin(th), rtol=1e-6)


def test_multi_position_rows_are_checked_whole():
    """M-RoPE: a token whose second component changed (an image's row) is remade. Mutation:
    comparing component 0 only fails it."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, 64)).astype(np.float32)
    args = ARGS[:6] + (np.array([0] * 16 + [1] * 16, np.int64),)
    table = ops.rope_table(4, 64, 2)
    a = np.array([[5, 5], [6, 6], [7, 7], [8, 8]], np.int32)
    b = a.copy()
    b[:, 1] += 3
    _rope(x, a, args, table)
    np.testing.assert_array_equal(_rope(x, b, args, table), _rope(x, b, args))


def test_tables_are_per_kind_and_per_thread():
    """Gemma 3's local and global layers (two bases) alternate within a step: each kind has its
    own table, or one would read the other's angles; two engines' threads never share one.
    Mutation: leaving the base out of backend._angles's key, or keeping one dict for all threads,
    fails it."""
    local = (64, 10000.0, 1.0, True, ARGS[4], 1.0, ARGS[6])
    glob = (64, 1000000.0, 1.0, True, ARGS[4], 1.0, ARGS[6])
    a, b = cpu_backend._angles(local, 4, 1), cpu_backend._angles(glob, 4, 1)
    assert a[0] is not b[0]
    assert cpu_backend._angles(local, 3, 1)[0] is a[0]  # the same kind again: the same table
    assert cpu_backend._angles(local, 64, 1)[0].shape[0] >= 64  # grown for a longer batch
    other = []
    t = threading.Thread(target=lambda: other.append(cpu_backend._angles(local, 4, 1)[0]))
    t.start()
    t.join()
    assert other[0] is not cpu_backend._angles(local, 4, 1)[0]
