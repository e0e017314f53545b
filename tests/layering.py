"""The house's layering, measured: an AST scan of every import in the package, lazy ones included.

`python tests/layering.py` prints the figures; tests/test_layering.py holds them to the targets
(no import cycle, no upward import, a short engine, no long function in runtime/ or sdk/).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> import prefix, as pyproject's package-dir map installs them
FOLDERS = {"core": "hearthlm.core", "backends": "hearthlm.backends", "runtime": "hearthlm.runtime",
           "model_zoo": "hearthlm.model_zoo", "sdk": "hearthlm"}
# which floors each floor must not import (DESIGN.md: sdk -> runtime -> backends -> core,
# model_zoo -> runtime, core)
FORBIDDEN = {"core": {"backends", "runtime", "model_zoo", "sdk"},
             "backends": {"runtime", "model_zoo", "sdk"},
             "runtime": {"model_zoo", "sdk"},
             "model_zoo": {"backends", "sdk"},
             "sdk": set()}


@dataclass
class Scan:
    modules: dict[str, Path] = field(default_factory=dict)          # module -> file
    imports: dict[str, set[str]] = field(default_factory=dict)      # module -> package modules it imports
    upward: list[tuple[str, str, int]] = field(default_factory=list)  # (module, imported, line)


def module_of(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root)
    prefix = FOLDERS[rel.parts[0]]
    parts = list(rel.parts[1:])
    parts[-1] = parts[-1][:-3]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def floor_of(module: str) -> str:
    for folder, prefix in FOLDERS.items():
        if folder != "sdk" and (module == prefix or module.startswith(prefix + ".")):
            return folder
    return "sdk"


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(root: Path = ROOT) -> Scan:
    s = Scan()
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            s.modules[module_of(path, root)] = path
    for mod, path in s.modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(tree):
            names: list[tuple[str, int]] = []
            if isinstance(node, ast.Import):
                names = [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                # `from pkg import submodule` imports the submodule
                names = [(f"{base}.{a.name}" if f"{base}.{a.name}" in s.modules else base, node.lineno)
                         for a in node.names]
            for name, line in names:
                if not name.startswith("hearthlm"):
                    continue
                while name and name not in s.modules:
                    name = name.rpartition(".")[0]
                if not name or name == mod:
                    continue
                found.add(name)
                if floor_of(name) in FORBIDDEN[floor_of(mod)]:
                    s.upward.append((mod, name, line))
        s.imports[mod] = found
    return s


def cycles(s: Scan) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(s.imports.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(s.imports):
        if v not in index:
            visit(v)
    return out


def long_functions(folders: tuple[str, ...] = ("runtime", "sdk"), limit: int = 100,
                   root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(file, function, lines) for each function longer than `limit` lines."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append((str(path.relative_to(root)), node.name, n))
    return out


def class_lines(path: str, name: str) -> int:
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise LookupError(f"{name} not in {path}")


if __name__ == "__main__":
    s = scan()
    cyc = cycles(s)
    print(f"modules: {len(s.modules)}")
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  ", " <-> ".join(c))
    print(f"upward imports: {len(s.upward)}")
    for m, n, line in s.upward:
        print(f"   {m}:{line} -> {n}")
    print(f"Engine: {class_lines('runtime/engine.py', 'Engine')} lines")
    longf = long_functions()
    print(f"functions over 100 lines in runtime/, sdk/: {len(longf)}")
    for f, name, n in longf:
        print(f"   {f}:{name} {n}")
