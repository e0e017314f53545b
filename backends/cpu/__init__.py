"""The numba CPU backend."""
import os

# numba's OpenMP workers spin after each parallel region, then sleep. Woken from sleep for a
# kernel under EEVDF scheduling (Linux 6.6+), a worker can wait milliseconds behind even a
# nice-19 process: SmolLM2 decode kept 0.73 of its quiet rate beside one with a spin of 10k
# (a 2-thread step took 62 ms instead of 8). libgomp's default of 300k (~4 ms of one core
# after a burst's last kernel) keeps them awake through a step's gaps: kept 0.93-0.99 at nice
# 19, 0.5-0.6 beside a nice-0 competitor. Longer spins (1M, 3M) kept no more at nice 19 and let
# the app's event loop wait over 50 ms beside a nice-0 one. An application's own setting wins;
# it must be set before OpenMP first loads.
os.environ.setdefault("GOMP_SPINCOUNT", "300000")
