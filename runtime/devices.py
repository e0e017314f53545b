"""Opening the devices a session runs on: "cpu", "cuda", or "auto" (the GPU where one
answers, else the CPU). runtime.placement then spreads the layers over what opened."""
from __future__ import annotations

from typing import Callable

from hearthlm.core.backend import Backend
from hearthlm.core.errors import BackendError, InvalidRequestError
from hearthlm.core.log import get_logger

log = get_logger("hearthlm.devices")


def open_device(device: str, n_gpu_layers: int | None, make_backend: Callable[[str], Backend]) -> dict[str, Backend]:
    """The backends of `device`: {"cpu"}, or {"cpu", "cuda"} for "cuda" (BackendError where
    CuPy or a GPU is missing) and for "auto" where a GPU answers."""
    if n_gpu_layers is not None and (isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int)
                                     or n_gpu_layers < 0):
        raise InvalidRequestError(f"n_gpu_layers must be None (all) or an int >= 0, got {n_gpu_layers!r}")
    if device not in ("cpu", "cuda", "auto"):
        raise InvalidRequestError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cpu":
        if n_gpu_layers:
            raise InvalidRequestError(f"n_gpu_layers={n_gpu_layers} needs device='cuda' or 'auto'")
        return {"cpu": make_backend("cpu")}
    try:
        gpu = make_backend("cuda")
    except BackendError as e:
        if device == "cuda":
            raise BackendError(f"device='cuda' is not available: {e}") from e
        log.info("device_auto", chose="cpu", why=str(e))
        return {"cpu": make_backend("cpu")}
    return {"cpu": make_backend("cpu"), "cuda": gpu}
