"""Hub downloads for real, against a local server speaking the Hub's API (tests/fake_hub.py,
through HF_ENDPOINT): `hearthlm pull` with its progress bar and a resume after a cut
connection, `hearthlm models`, Session.open(progress=) and the offline error. The CLI runs
in subprocesses: huggingface_hub reads HF_ENDPOINT once, at import. No test needs the internet."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub
from tiny_gguf import write_tiny

REPO = "owner/tiny-GGUF"
NAME = "tiny-Q8_0.gguf"


@pytest.fixture
def model_bytes(tmp_path) -> bytes:
    return write_tiny(tmp_path / "src.gguf").read_bytes()


def run(args: list[str], hub: FakeHub, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"),
         "HEARTHLM_CACHE": str(tmp_path / "hearth"), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    e.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    return subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=180)


def test_pull_resumes_after_cut_connection(tmp_path, model_bytes):
    cut = len(model_bytes) // 3
    with FakeHub(REPO, {NAME: model_bytes, "README.md": b"# tiny"}) as hub:
        hub.cut_at, hub.down_after_cut = cut, True  # cut partway, then down: this pull fails
        first = run(["-m", "hearthlm", "pull", REPO], hub, tmp_path)
        assert first.returncode == 1 and "hearthlm: error:" in first.stderr and "Traceback" not in first.stderr
        partial = list((tmp_path / "hub").rglob("*.part"))
        assert len(partial) == 1 and partial[0].stat().st_size == cut  # what came is kept
        hub.down = False
        second = run(["-m", "hearthlm", "pull", REPO, "--file", "*q8_0*"], hub, tmp_path)
        assert second.returncode == 0, second.stderr
        path = Path(second.stdout.split()[0])
        assert path.read_bytes() == model_bytes and COMMIT in str(path)
        gets = [r for m, p, r in hub.log if m == "GET" and p.endswith(NAME)]
        assert gets[-1] == f"bytes={cut}-"  # resumed, not fetched again from 0
        assert NAME in second.stderr and "100%" in second.stderr  # the progress bar
        listed = run(["-m", "hearthlm", "models"], hub, tmp_path)
        assert "smollm2-135m-instruct" in listed.stdout and REPO in listed.stdout and str(path) in listed.stdout
        assert "KiB" in listed.stdout


def test_pull_unknown_file_names_candidates(tmp_path, model_bytes):
    with FakeHub(REPO, {NAME: model_bytes}) as hub:
        r = run(["-m", "hearthlm", "pull", REPO, "--file", "*Q4_K_M*"], hub, tmp_path)
    assert r.returncode == 1 and NAME in r.stderr and "*Q4_K_M*" in r.stderr


def test_session_open_downloads_with_progress(tmp_path, model_bytes):
    script = textwrap.dedent(f"""
        import asyncio, json
        from hearthlm import Session
        calls = []
        async def main():
            async with Session.open({REPO!r}, n_ctx=128, progress=lambda *a: calls.append(a)) as s:
                c = await s.generate("hi", max_tokens=2, temperature=0)
            print(json.dumps(dict(calls=calls, tokens=len(c.token_ids))))
        asyncio.run(main())
    """)
    with FakeHub(REPO, {NAME: model_bytes}) as hub:
        hub.cut_at = len(model_bytes) // 2  # cut once: huggingface_hub resumes within the same call
        r = run(["-c", script], hub, tmp_path)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        done = [d for name, d, total in out["calls"] if name == NAME]
        assert done[-1] == len(model_bytes) and done == sorted(done)
        assert {t for _, _, t in out["calls"]} == {len(model_bytes)} and out["tokens"] >= 1
        assert any(r_ and r_.startswith("bytes=") for _, _, r_ in hub.log)
        # the default: a log line (no bar) while downloading
        logged = run(["-c", script.replace("progress=lambda *a: calls.append(a)", "")], hub, tmp_path / "again")
    assert logged.returncode == 0 and "downloading" in logged.stdout + logged.stderr


def test_offline_error_names_what_is_missing(tmp_path, model_bytes):
    with FakeHub(REPO, {NAME: model_bytes}) as hub:
        r = run(["-m", "hearthlm", "generate", "hi", "--model", "owner/absent-GGUF"], hub, tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "owner/absent-GGUF" in r.stderr and "HF_HUB_OFFLINE" in r.stderr and "hearthlm pull" in r.stderr
    assert hub.log == []  # offline: not one request


def test_offline_flag_read_in_a_fresh_interpreter():
    """Issue 13's AttributeError: huggingface_hub 2.x loads `constants` lazily, so reading
    huggingface_hub.constants without importing it failed whenever HF_HUB_OFFLINE was unset."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    code = "from hearthlm.model_zoo.resolve import _env_offline; print(_env_offline())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
