"""The long fuzz run (`make fuzz`): every target in turn, in one process at a time, for an
equal share of --seconds; a target whose process dies (a libFuzzer timeout or crash, an
uncatchable out-of-memory) is restarted for the rest of its share, and the death counts as
a finding. Ends with a summary table (also OUT/summary.json); `--report OUT` prints the
summary of a run that is still going or was stopped.

    python tests/fuzz/run.py --seconds 3600 --out /tmp/hearthlm-fuzz
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fuzz.engine import TARGETS  # noqa: E402


def run_target(target: str, seconds: float, out: Path, seed: int, extra: list[str]) -> None:
    end, k = time.time() + seconds, 0
    while (left := end - time.time()) > 5:
        stats = out / f"{target}.json"
        stats.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "engine.py"), target, "--out", str(out), "--seconds", f"{left:.0f}",
               "--seed", str(seed + k), "--corpus", str(out / "corpus" / target), *extra]
        print(f"== {time.strftime('%H:%M:%S')} {target}: {left:.0f} s (start {k})", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=left + 120).returncode
        except subprocess.TimeoutExpired:
            rc = "wall timeout"
        if stats.exists():
            stats.rename(out / f"{target}-{k}.json")
        if rc != 0:  # the process died: libFuzzer left its artifact in findings/TARGET/
            (out / f"{target}-{k}.died").write_text(f"exit {rc}\n")
            print(f"== {target}: process ended with {rc}; restarting", flush=True)
        k += 1


def summary(out: Path) -> dict:
    rows = {}
    for t in TARGETS:
        parts = sorted(out.glob(f"{t}-*.json")) + ([out / f"{t}.json"] if (out / f"{t}.json").exists() else [])
        runs = [json.loads(p.read_text()) for p in parts]
        findings: dict[str, dict] = {}
        for r in runs:
            for f in r["findings"]:
                key = f"{f['kind']} {f['where']} {f['error'][:80]}"
                findings.setdefault(key, dict(f, count=0))["count"] += f["count"]
        died = [p.read_text().strip() for p in sorted(out.glob(f"{t}-*.died"))]
        artifacts = sorted(str(p) for kind in ("crash", "timeout", "oom", "leak")  # libFuzzer's, when it ends a process
                           for p in (out / "findings" / t).glob(f"{kind}-*") if not p.suffix)
        rows[t] = dict(seconds=sum(r["seconds"] for r in runs), cpu_seconds=sum(r.get("cpu_seconds", 0) for r in runs),
                       execs=sum(r["execs"] for r in runs), starts=len(runs), died=died,
                       libfuzzer_artifacts=artifacts, findings=list(findings.values()))
    return rows


def print_summary(rows: dict, out: Path) -> None:
    total_s = sum(r["seconds"] for r in rows.values())
    total_x = sum(r["execs"] for r in rows.values())
    print(f"\nFUZZ SUMMARY ({out}): {total_s / 3600:.2f} h, {total_x} executions")
    print(f"{'target':<10} {'wall s':>8} {'cpu s':>8} {'execs':>10} {'exec/s':>8} {'findings':>9} {'deaths':>7}")
    for t, r in rows.items():
        rate = r["execs"] / r["seconds"] if r["seconds"] else 0
        print(f"{t:<10} {r['seconds']:>8.0f} {r['cpu_seconds']:>8.0f} {r['execs']:>10} {rate:>8.1f} "
              f"{len(r['findings']):>9} {len(r['died']):>7}")
    for t, r in rows.items():
        for f in r["findings"]:
            print(f"  {t}: {f['kind']} at {f['where']} x{f['count']}: {f['error'][:120]}\n      {f['file']}")
        for a in r["libfuzzer_artifacts"]:
            print(f"  {t}: process died, input kept in {a}")
    print(f"FUZZ TOTAL: {total_s / 3600:.2f} h, {total_x} executions, "
          f"{sum(len(r['findings']) + len(r['libfuzzer_artifacts']) for r in rows.values())} distinct findings")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path("/tmp/hearthlm-fuzz"))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="only print the summary of --out")
    a, extra = ap.parse_known_args()  # the rest goes to engine.py (--time-limit, ...)
    if not a.report:
        a.out.mkdir(parents=True, exist_ok=True)
        for p in list(a.out.glob("*.json")) + list(a.out.glob("*.died")):
            p.unlink()  # an earlier run's figures and findings go; its corpus stays
        shutil.rmtree(a.out / "findings", ignore_errors=True)
        targets = a.targets.split(",")
        start = time.time()
        for i, t in enumerate(targets):
            # an equal share of what is left, so that a slow start does not starve the last
            run_target(t, (a.seconds - (time.time() - start)) / (len(targets) - i), a.out, a.seed, extra)
    rows = summary(a.out)
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print_summary(rows, a.out)


if __name__ == "__main__":
    main()
