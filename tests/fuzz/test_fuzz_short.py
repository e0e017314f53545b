"""A bounded run of each fuzz target in `make test`: seed 1, a fixed number of inputs (capped
at 20 s of wall time on a slow machine), about 30 s for all three (`make fuzz` runs for longer).
Each runs in its own process, as the long run does (`make fuzz`, tests/fuzz/run.py): atheris can start only once
per process, and the address-space cap must not reach pytest."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.engine import TARGETS

ENGINE = Path(__file__).parent / "engine.py"
RUNS = {"gguf": 1500, "tokenizer": 300, "template": 1200}
# peak-RSS growth an input may cause, MB: a template may render a million characters (a 128k context
# admits 4 M), and the byte-level BPE (the `tokenizers` library) takes ~220 bytes a character for one
# pre-token piece that long: 219 MB for 1 M spaces under llama3's split (found on a fast host, which
# reaches that input within the time cap). The bound still catches growth past that
RSS_STEP = {"gguf": 100, "tokenizer": 100, "template": 256}
# Reported and xfail in tests/test_fuzz_regressions.py; tolerated here until fixed, so that
# this run still catches anything new. Remove an entry when its fix lands.
KNOWN: list[str] = []  # findings tolerated until fixed (none now)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_bounded(target: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ENGINE), target, "--out", str(tmp_path), "--seed", "1",
                           "--runs", str(RUNS[target]), "--seconds", "20", "--rss-step", str(RSS_STEP[target])],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]  # a libFuzzer timeout or a hard crash
    stats = json.loads((tmp_path / f"{target}.json").read_text())
    assert stats["final"] and stats["execs"] >= 50, stats
    found = [f for f in stats["findings"] if not any(k in f["error"] for k in KNOWN)]
    assert not found, "\n\n".join(Path(f["file"]).read_text()[:4000] for f in found)
