"""Runs one fuzz target: atheris (coverage-guided libFuzzer) where it installs, else hypothesis
over the same input bytes.

    python tests/fuzz/engine.py TARGET --out DIR [--seconds S] [--runs N] [--seed N]

An input may end in a result or a hearthlm.HearthError, nothing else. A finding is any other
exception ("crash"), more than --time-limit CPU seconds ("hang"; CPU time, so that a niced run
on shared cores is judged fairly), or a MemoryError / an input's peak RSS more than --rss-step
MB above its start ("memory"; issue 14 allows a hostile input 100 MB). Findings are recorded
and the run goes on, so one long run reports them all: DIR/findings/TARGET/<kind>-<key>.bin
(the input) and .txt (the decoded case and the traceback); DIR/TARGET.json sums up executions
and findings.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import resource
import signal
import sys
import sysconfig
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

HearthError: type = Exception  # set in main(), after atheris has hooked the imports of hearthlm

TARGETS = ("gguf", "tokenizer", "template")


class Draw:
    """Choices decoded from the fuzzer's bytes, so that coverage guidance steers them; an
    exhausted input reads as zeros (the first choice), which keeps every input valid."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def bytes(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b.ljust(n, b"\0")

    def int(self, n: int) -> int:
        """0 <= i < n."""
        if n <= 1:
            return 0
        width = 1 if n <= 256 else 2 if n <= 65536 else 8
        return int.from_bytes(self.bytes(width), "little") % n

    def bool(self) -> bool:
        return self.int(2) == 1

    def pick(self, seq):
        return seq[self.int(len(seq))]

    def u64(self) -> int:
        return int.from_bytes(self.bytes(8), "little")

    def rest(self) -> bytes:
        b, self.pos = self.data[self.pos:], len(self.data)
        return b


class FuzzTimeout(BaseException):
    """Raised by the CPU timer; a BaseException so that `except Exception` in the code under
    test cannot turn a hang into an allowed error."""


def _on_timer(signum, frame):
    raise FuzzTimeout()


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak_rss() -> bool:
    """Resets the peak RSS (VmHWM), so that every input's own peak is seen, not only new highs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


_STDLIB = sysconfig.get_paths()["stdlib"]


def _where(tb, kind: str) -> str:
    """Where a finding lies: for a crash the innermost line in hearthlm (else jinja2, else
    any); for a hang the innermost function outside the stdlib and tracers, since the timer
    lands on a different line each time."""
    frames = [fr for fr in traceback.extract_tb(tb) if "/tests/fuzz/" not in fr.filename]
    if kind == "hang":
        frames = [fr for fr in frames if not fr.filename.startswith(_STDLIB)
                  and fr.name not in ("trace", "_line")] or frames
        return f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
    for marker in ("hearthlm", "/model_zoo/", "/runtime/", "jinja2", ""):
        for fr in reversed(frames):
            if marker in fr.filename:
                return f"{Path(fr.filename).name}:{fr.lineno}"
    return "?"


class Runner:
    def __init__(self, target, out: Path, *, seconds: float, runs: int, time_limit: float,
                 rss_step: float):
        self.t, self.name = target, target.NAME
        self.dir = out / "findings" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats_path = out / f"{self.name}.json"
        self.seconds, self.runs, self.limit, self.rss_step = seconds, runs, time_limit, rss_step
        self.execs, self.findings = 0, {}  # key -> {kind, where, error, count, file}
        self.start = self.last_flush = time.time()
        signal.signal(signal.SIGPROF, _on_timer)

    def one(self, data: bytes) -> None:
        rss0 = _status_mb("VmRSS") if _reset_peak_rss() else _status_mb("VmHWM")
        cpu0 = time.process_time()
        signal.setitimer(signal.ITIMER_PROF, self.limit)
        try:
            self.t.one_input(data)
            kind = None
        except HearthError:
            kind = None
        except FuzzTimeout:
            kind, err = "hang", sys.exc_info()
        except MemoryError:
            kind, err = "memory", sys.exc_info()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # also a Rust panic from a binding (pyo3's PanicException)
            kind, err = "crash", sys.exc_info()
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        took, grew = time.process_time() - cpu0, _status_mb("VmHWM") - rss0
        if kind is None and took > self.limit * 1.5:  # stuck in C code, the timer could not interrupt
            kind, err = "hang", (None, f"{took:.1f} s of CPU in uninterruptible code", None)
        if kind is None and grew > self.rss_step:
            kind, err = "memory", (None, f"peak RSS grew {grew:.0f} MB", None)
        self.execs += 1
        if kind:
            self.record(kind, err, data, took, grew)
        now = time.time()
        if now - self.last_flush > 5:
            self.flush()
        if (self.runs and self.execs >= self.runs) or (self.seconds and now - self.start >= self.seconds):
            self.flush(final=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # libFuzzer's own exit skips Python's atexit: stop here, stats written

    def record(self, kind: str, err, data: bytes, took: float, grew: float) -> None:
        etype, evalue, tb = err
        if tb is not None:
            where, error = _where(tb, kind), f"{etype.__name__}: {evalue}"[:500]
            text = "".join(traceback.format_exception(etype, evalue, tb))
        else:  # measured after the fact: no traceback; keep a few distinct examples
            where, error, text = "-", str(evalue), str(evalue) + "\n"
        key = f"{kind}-{etype.__name__ if etype else 'limit'}-{where}"
        if where == "-":
            key += f"-{sum(1 for k in self.findings if k.startswith(key)) % 5}"
        f = self.findings.get(key)
        if f is None:
            stem = f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            (self.dir / f"{stem}.bin").write_bytes(data)
            try:
                case = self.t.describe(data)
            except Exception as e:  # the description is only a help for the reader
                case = f"(describe failed: {e!r})"
            (self.dir / f"{stem}.txt").write_text(
                f"target {self.name}, {kind} at {where}: {error}\nCPU {took:.2f} s, peak RSS "
                f"+{grew:.0f} MB\n\ncase:\n{case}\n\n{text}")
            f = self.findings[key] = dict(kind=kind, where=where, error=error, count=0,
                                          file=str(self.dir / f"{stem}.txt"))
            print(f"FINDING {self.name}: {kind} at {where}: {error[:200]}", file=sys.stderr, flush=True)
            self.flush()
        f["count"] += 1

    def flush(self, final: bool = False) -> None:
        elapsed = time.time() - self.start
        self.stats_path.write_text(json.dumps(dict(
            target=self.name, execs=self.execs, seconds=round(elapsed, 1),
            cpu_seconds=round(time.process_time(), 1),
            execs_per_s=round(self.execs / max(elapsed, 1e-9), 1), final=final,
            findings=list(self.findings.values())), indent=1))
        self.last_flush = time.time()


def _cap_memory(cap_mb: float) -> None:
    # Address space beyond what is mapped now + cap: a runaway allocation becomes a MemoryError.
    soft = int((_status_mb("VmSize") + cap_mb) * 2**20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=3.0, help="CPU seconds per input")
    ap.add_argument("--rss-step", type=float, default=100, help="MB of peak-RSS growth per input")
    ap.add_argument("--memory-cap", type=float, default=2048, help="MB of address space over the start")
    ap.add_argument("--corpus", type=Path, help="libFuzzer corpus folder (kept between runs)")
    ap.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    a = ap.parse_args(argv)
    if not (a.seconds or a.runs):
        ap.error("give --seconds or --runs")
    engine = a.engine
    if engine == "auto":
        engine = "atheris" if importlib.util.find_spec("atheris") else "hypothesis"

    global HearthError
    if engine == "atheris":
        import atheris
        with atheris.instrument_imports(include=["hearthlm", "jinja2"]):
            import hearthlm  # noqa: F401  (the whole package, instrumented for coverage)
            target = importlib.import_module(f"fuzz.{a.target}_target")
    else:
        target = importlib.import_module(f"fuzz.{a.target}_target")
    from hearthlm.core.errors import HearthError
    runner = Runner(target, a.out, seconds=a.seconds, runs=a.runs, time_limit=a.time_limit,
                    rss_step=a.rss_step)
    seeds = target.seeds()
    getattr(target, "warm", lambda: None)()  # one-time loads (real vocabularies), not an input's memory
    _cap_memory(a.memory_cap)
    print(f"fuzz {a.target}: {engine}, {len(seeds)} seeds, seed {a.seed}, "
          f"{a.seconds or '-'} s / {a.runs or '-'} runs", file=sys.stderr, flush=True)

    if engine == "atheris":
        corpus = a.corpus or a.out / "corpus" / a.target
        corpus.mkdir(parents=True, exist_ok=True)
        for s in seeds:
            (corpus / f"seed-{hashlib.sha1(s).hexdigest()[:12]}").write_bytes(s)
        atheris.Setup([sys.argv[0], f"-seed={a.seed}", f"-max_len={target.MAX_LEN}",
                       f"-timeout={int(max(300, 20 * a.time_limit))}", "-rss_limit_mb=4096", "-len_control=0",
                       "-report_slow_units=100000",  # libFuzzer's clocks are wall time, which means little
                       # under nice on shared cores: the CPU timer above judges; these only back it up
                       f"-artifact_prefix={runner.dir}/", str(corpus)],
                      runner.one)
        atheris.Fuzz()
    else:
        from hypothesis import HealthCheck, given, seed, settings
        from hypothesis import strategies as st
        for s in seeds:  # libFuzzer runs its corpus first; here the seeds go first by hand
            runner.one(s)

        @seed(a.seed)
        @settings(max_examples=10**9, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(st.binary(max_size=target.MAX_LEN))
        def run(data: bytes) -> None:
            runner.one(data)

        run()
    runner.flush(final=True)


if __name__ == "__main__":
    main()
