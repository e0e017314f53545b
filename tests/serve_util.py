"""Helpers for the server tests: a live `hearthlm serve` subprocess on 127.0.0.1 and its
/metrics read back as numbers. Every wait is bounded."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*args: str, timeout: float = 120.0, env: dict | None = None):
    """`python -m hearthlm serve ARGS` on a free port; yields its base URL (…/v1 is the API)."""
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"hearthlm-serve-{port}.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "hearthlm", "serve", *args, "--port", str(port)],
                             stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"hearthlm serve exited {p.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"hearthlm serve not healthy after {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value}, labels dropped (one model per test server)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? ([-+\deE.naif]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_for(pred, timeout: float = 20.0, every: float = 0.1):
    """Poll pred() until it returns a truthy value or the timeout passes; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(every)
