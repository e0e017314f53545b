"""The numba CPU backend."""
import os

# numba's OpenMP workers spin after each parallel region; by default long enough to starve
# the engine thread and BLAS on a 2-core machine (a 100-token prefill took 1.8 s instead of
# 0.3 s here). A short spin keeps them hot between a step's kernels and asleep between steps.
# An application's own setting wins; it must be set before OpenMP first loads.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from . import kernel_stamp  # noqa: E402  (before any cached kernel is decorated)

kernel_stamp.install()
