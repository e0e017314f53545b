"""A bounded run of each fuzz target in `make test`: seed 1, a fixed number of inputs (capped
at 40 s of wall time on a slow machine), about a minute for all three. Each runs in its own
process, as the long run does (`make fuzz`, tests/fuzz/run.py): atheris can start only once
per process, and the address-space cap must not reach pytest."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.engine import TARGETS

ENGINE = Path(__file__).parent / "engine.py"
RUNS = {"gguf": 3000, "tokenizer": 600, "template": 2500}

# Findings in the template renderer (model_zoo/chat_template.py, template_limits.py), reported
# to its owner with their regression tests in tests/test_fuzz_regressions.py (xfail there).
# Tolerated here until fixed, so that this run still catches anything new; remove when fixed.
KNOWN_RENDERER = [
    ("crash", r"SyntaxError: '(continue|break)' (not properly in|outside) loop"),
    ("hang", r"generate_lorem_ipsum"),
]


def _known(f: dict) -> bool:
    return any(f["kind"] == kind and re.search(pat, f"{f['where']} {f['error']}")
               for kind, pat in KNOWN_RENDERER)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_bounded(target: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ENGINE), target, "--out", str(tmp_path), "--seed", "1",
                           "--runs", str(RUNS[target]), "--seconds", "40"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]  # a libFuzzer timeout or a hard crash
    stats = json.loads((tmp_path / f"{target}.json").read_text())
    assert stats["final"] and stats["execs"] >= 50, stats
    new = [f for f in stats["findings"] if not _known(f)]
    assert not new, "\n\n".join(Path(f["file"]).read_text()[:4000] for f in new)
