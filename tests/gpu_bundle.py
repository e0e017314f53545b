"""Wheels for the GPU machine, which has no network: `make gpu-bundle` writes .gpu-bundle/
(hearthlm's wheel and the dependencies that machine lacks, for CPython 3.12 manylinux
x86_64, with MANIFEST.json), and `make gpu-bundle-check` installs it offline, as
tests/gpu_check.sh does there, into a fresh Python 3.12 holding only what that machine
has, then generates on the CPU with it.
    python tests/gpu_bundle.py build [DIR]       (run with the project's .venv python)
    python tests/gpu_bundle.py check PYTHON3.12 [DIR]
    python tests/gpu_bundle.py tree-hash         (stdlib only: gpu_check.sh runs it there)"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu-bundle"
LIMIT = 64 << 20  # what the device tool carries, the working tree included
# What the H200 machine's image already holds, of what hearthlm and its bundled dependencies
# need (its package list, read 2026-11; python3 there is 3.12.3 with numpy 2.x and
# cupy-cuda13x). A dependency missing here is bundled.
DEVICE_HAS = {"numpy", "numba", "llvmlite", "huggingface-hub", "anyio", "tokenizers", "jinja2", "markupsafe",
              "threadpoolctl", "pyyaml", "requests", "tqdm", "typing-extensions", "idna", "certifi", "urllib3",
              "charset-normalizer", "packaging", "filelock", "fsspec", "pytest", "cupy-cuda13x"}
TARGET = dict(python_version="3.12", python_full_version="3.12.3", sys_platform="linux", platform_system="Linux",
              platform_machine="x86_64", os_name="posix", implementation_name="cpython",
              platform_python_implementation="CPython", extra="")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
SMOKE = """
import sys, tempfile, asyncio
from pathlib import Path
import hearthlm
assert hearthlm.__file__.startswith(sys.argv[1]), f"hearthlm imported from {hearthlm.__file__}"
kernels = sorted(p.name for p in (Path(hearthlm.__file__).parent / "backends/cuda/kernels").iterdir())
print("hearthlm from", hearthlm.__file__, "| cuda kernel sources:", kernels)
assert {"matmul.cu", "attention.cu", "norm_rope.cu", "ssm.cu", "delta_net.cu", "quants.cuh", "common.cuh"} <= set(kernels)
from hearthlm.backends.cuda.backend import CUDABackend
from hearthlm.core.errors import BackendError
try:
    CUDABackend()
except BackendError as e:
    print("cuda backend, as expected without CuPy:", e)
from tiny_gguf import write_tiny
from hearthlm import Session

async def main(path):
    async with Session.open(str(path), backend="cpu") as s:
        c = await s.generate("hello there", max_tokens=12, temperature=0)
    print(f"generated {len(c.token_ids)} tokens on the cpu backend: {c.token_ids}")
    assert len(c.token_ids) > 0

with tempfile.TemporaryDirectory() as d:
    asyncio.run(main(write_tiny(Path(d) / "tiny.gguf", "llama")))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tree_hash() -> str:
    """sha256 of the package sources (the folders pyproject maps into hearthlm) and pyproject:
    the bundle's wheel is stale when this differs from its MANIFEST's."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    h = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    for d in sorted(set(meta["tool"]["setuptools"]["package-dir"].values())):
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".jinja"):
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _requires(wheel: Path) -> list[str]:
    """Names a wheel needs on Python 3.12 Linux (its Requires-Dist, extras left out)."""
    from zipfile import ZipFile

    from packaging.requirements import Requirement
    with ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1]) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    return [_norm(r.name) for r in reqs if r.marker is None or r.marker.evaluate(TARGET)]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def build(out: Path) -> None:
    from packaging.requirements import Requirement
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = tree_hash()  # before the wheel: an edit made meanwhile shows as stale, not as current
    _pip("wheel", "--no-deps", "-w", str(out), str(ROOT))
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    todo = [_norm(Requirement(r).name) for r in meta["project"]["dependencies"]]
    done = set(DEVICE_HAS) | {"hearthlm"}
    while todo:  # the missing dependencies and theirs: the versions tested here, wheels for 3.12
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        v = _version(name)
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
             *platforms, "-d", str(out), f"{name}=={v}" if v else name)
        wheel = next(w for w in out.glob("*.whl") if _norm(w.name.split("-")[0]) == name)
        todo += _requires(wheel)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size >= LIMIT:
        sys.exit(f"gpu-bundle: {size} bytes, over the {LIMIT} the device carries")
    (out / "MANIFEST.json").write_text(json.dumps(
        {"tree_sha256": tree, "python": "3.12", "wheels": {w.name: w.stat().st_size for w in wheels}},
        indent=1) + "\n")
    print(f"{out}: {len(wheels)} wheels, {size / 1024:.0f} KiB")
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 1024:.0f} KiB")


def check(python: str, bundle: Path) -> None:
    """A Python 3.12 venv with what the device has (from PyPI), the bundle installed offline
    into a --target folder as gpu_check.sh does there, then a generation on the CPU."""
    venv = Path(os.environ.get("GPU_BUNDLE_CHECK_VENV", "/tmp/hearthlm-py312-check"))
    site = venv.with_name(venv.name + "-site")
    vpy = str(venv / "bin" / "python")
    have = sorted(DEVICE_HAS - {"cupy-cuda13x"})  # no GPU here
    stamp = venv / "stamp.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != have:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([vpy, "-m", "pip", "-q", "install", "numpy>=2", *have], check=True)
        stamp.write_text(json.dumps(have))
    run = lambda *a, **kw: subprocess.run([vpy, *a], check=True, **kw)  # noqa: E731
    run("-c", "import sys, numpy; print('venv:', sys.version.split()[0], 'numpy', numpy.__version__)")
    missing = json.loads((bundle / "MANIFEST.json").read_text())["wheels"]
    # the bundled packages must come from the bundle, or this check proves nothing
    names = [w.split("-")[0] for w in missing if not w.startswith("hearthlm-")]
    run("-c", f"import importlib.util as u; have = [n for n in {names!r} if u.find_spec(n)]; "
              "assert not have, f'the venv already has {have}'")
    shutil.rmtree(site, ignore_errors=True)
    run("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
        "--target", str(site), *map(str, sorted(bundle.glob("*.whl"))))
    env = dict(os.environ, PYTHONPATH=f"{site}:{ROOT / 'tests'}")
    run("-c", SMOKE, str(site), env=env, cwd="/tmp")
    print("gpu-bundle check: passed")


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "tree-hash":
        print(tree_hash())
    elif cmd == "build":
        build(Path(rest[0]) if rest else BUNDLE)
    elif cmd == "check":
        check(rest[0], Path(rest[1]) if len(rest) > 1 else BUNDLE)
    else:
        sys.exit(__doc__)
