"""The house's layering (DESIGN.md, docs/architecture.md), measured by tests/layering.py's AST
scan of every import, lazy ones included, and held to the targets of issue #38."""
from __future__ import annotations

from pathlib import Path

import layering


def test_no_import_cycle():
    """Catches a cycle between modules (e.g. serve.app importing serve.ollama, which imports
    serve.app back, even inside a function)."""
    assert layering.cycles(layering.scan()) == []


def test_no_upward_import():
    """backends import only core; runtime never imports model_zoo or sdk; model_zoo never
    imports backends or sdk; core imports no other floor. Catches, e.g., a backend reaching
    into runtime.dispatch from inside a function, as cuda/graphs.py once did."""
    assert layering.scan().upward == []


def test_engine_and_functions_stay_short():
    """Engine <= 300 lines; no function in runtime/ or sdk/ over 100 lines (the engine and the
    server's routes were the hubs every feature touched)."""
    assert layering.class_lines("runtime/engine.py", "Engine") <= 300
    assert layering.long_functions() == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for folder in layering.FOLDERS:
        (root / folder).mkdir(exist_ok=True)
    return root


def test_the_scan_sees_lazy_relative_and_from_imports(tmp_path):
    """The scanner itself: an import inside a function, a relative import and a `from pkg import
    module` all count, and a two-module cycle is found. Catches a scan that reads only
    module-level statements (iterating tree.body instead of ast.walk), which would miss the
    lazy imports the issue counted."""
    root = _tree(tmp_path, {
        "backends/__init__.py": "",
        "backends/k.py": "def f():\n    from hearthlm.runtime import dispatch\n",
        "runtime/__init__.py": "",
        "runtime/dispatch.py": "from . import plan\n",
        "runtime/plan.py": "def g():\n    from hearthlm.runtime.dispatch import x\n",
        "sdk/__init__.py": "",
        "core/__init__.py": "",
        "model_zoo/__init__.py": "",
    })
    s = layering.scan(root)
    assert ("hearthlm.backends.k", "hearthlm.runtime.dispatch", 2) in s.upward
    assert layering.cycles(s) == [["hearthlm.runtime.dispatch", "hearthlm.runtime.plan"]]
    assert layering.long_functions(root=root) == []
