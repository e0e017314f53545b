"""The recurrent kernels flush subnormals (backends.cpu.fpmode): on Intel each subnormal operand
costs a microcode assist, and a Qwen3.5 layer's 4-token verify step took 1.7 ms instead of 0.36
with 44 of them in k. The mode is set inside the kernel only: numpy and other kernels on the same
threads keep IEEE subnormals afterwards."""
import numba
import numpy as np
import pytest

from hearthlm.backends.cpu import delta_net, ssm
from hearthlm.backends.cpu.fpmode import X86

pytestmark = pytest.mark.skipif(not X86, reason="the flush is x86's MXCSR; elsewhere nothing is set")

SUB = np.float32(1e-39)  # a subnormal float32


@numba.njit(parallel=True)
def _products(x, out):  # on numba's worker threads, as the kernels run
    for i in numba.prange(out.shape[0]):
        out[i] = x[i] * np.float32(0.5)


def _workers_keep_subnormals() -> bool:
    out = np.zeros(64, np.float32)
    _products(np.full(64, np.float32(2e-38)), out)
    return bool(np.all(out != 0))


def _delta(fn):
    n, h, d = 2, 4, 16
    state = np.zeros((2, h, d, d), np.float32)
    q = np.ones((n, h, d), np.float32)
    k = np.full((n, h, d), SUB, np.float32)  # S += delta k: subnormal rows without the flush
    v = np.ones((n, h, d), np.float32)
    g, beta = np.zeros((n, h), np.float32), np.ones((n, h), np.float32)
    out = np.empty((n, h, d), np.float32)
    fn(state, q, k, v, g, beta, np.array([0, n], np.int32), np.array([1], np.int32), np.empty(0, np.int32), 1.0, out)
    return state[1], out


@pytest.mark.parametrize("fn", [delta_net.gated_delta_net, delta_net.gated_delta_net_1], ids=["parallel", "serial"])
def test_delta_net_flushes_and_restores(fn):
    """Mutations caught: flush_subnormals() removed from delta_net._head (the state holds 1e-39s);
    restore_mode() removed (numpy's and the workers' subnormal products become 0 afterwards)."""
    state, out = _delta(fn)
    assert np.all(state == 0) and np.all(out == 0)
    assert np.float32(2e-38) * np.float32(0.5) != 0  # the calling thread (the serial kernel ran on it)
    assert _workers_keep_subnormals()


def test_ssm_scan_flushes_and_restores():
    """Mutations caught: flush_subnormals() removed from ssm.ssm_scan (the state holds B x dt's
    subnormals); restore_mode() removed (the workers' subnormal products become 0)."""
    n, h, p, d_s = 2, 4, 8, 16
    state = np.zeros((2, h, p, d_s), np.float32)
    x, dt = np.ones((n, h, p), np.float32), np.full((n, h), 30.0, np.float32)  # softplus(30) = 30
    b = np.full((n, 1, d_s), SUB, np.float32)
    c = np.ones((n, 1, d_s), np.float32)
    y = np.empty((n, h, p), np.float32)
    ssm.ssm_scan(state, x, dt, np.full(h, -1.0, np.float32), b, c, np.array([0, n], np.int32), np.array([1], np.int32),
                 np.empty(0, np.int32), y)
    assert np.all(state[1] == 0) and np.all(y == 0)
    assert _workers_keep_subnormals()
    with np.errstate(under="ignore"):
        assert np.float32(2e-38) * np.float32(0.5) != 0
