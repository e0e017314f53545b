"""`hearthlm chat` run as a user would: piped stdin (each line a turn, EOF ends), SIGINT while an
answer streams, Ctrl-C on a terminal (a pty), and a context overflow. Every answer is checked
against Session.generate(messages=...) of the conversation the chat should have sent.

The tiny random models answer greedily with the prompt's last token repeated, whatever came
before it, so the conversations are sampled (temperature 3, a fixed seed) where the history
must show in the answer: a seeded sample is as reproducible as a greedy one."""
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from hearthlm import Session

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny  # noqa: E402

ROOT = Path(__file__).parent.parent
HEARTHLM = [sys.executable, "-m", "hearthlm", "chat"]
SAMPLED = dict(temperature=3.0, seed=1)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGINT and ptys as POSIX has them")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("chat") / "tiny.gguf"))


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> str:
    """A model slow enough (about 2.5 ms a token here) that an answer of hundreds of tokens is
    still streaming when the signal comes."""
    return str(write_tiny(tmp_path_factory.mktemp("chat") / "slow.gguf", n_layer=8, n_embd=512, n_head=8,
                          n_head_kv=4, n_ff=1024))


def expected(model: str, conversations: list[list[dict]], *, n_ctx: int, **kw) -> list[str]:
    async def go():
        async with Session.open(model, n_ctx=n_ctx) as s:
            return [(await s.generate(messages=m, **kw)).text for m in conversations]
    return anyio.run(go)


def args(model: str, *extra: str) -> list[str]:
    return [*HEARTHLM, "--model", model, *extra]


def chat(model: str, lines: list[str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(args(model, *extra), input="".join(x + "\n" for x in lines).encode(),
                          capture_output=True, timeout=60, cwd=ROOT)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_piped_turns_commands_and_history(tiny):
    sys0, sys1, u1, u2, u3 = "You are terse.", "Be brief.", "Hello there", "And then?", "Why?"
    r = chat(tiny, [u1, u2, "/bogus", f"/system {sys1}", "/system", u3, "/reset", "", u2],
             "--system", sys0, "--max-tokens", "12", "--temperature", "3", "--seed", "1", "--n-ctx", "512")
    assert r.returncode == 0, r.stderr.decode()
    out, err = r.stdout.decode(), r.stderr.decode()
    s0, s1 = {"role": "system", "content": sys0}, {"role": "system", "content": sys1}
    a1, = expected(tiny, [[s0, user(u1)]], n_ctx=512, max_tokens=12, **SAMPLED)
    a2, alone = expected(tiny, [[s0, user(u1), assistant(a1), user(u2)], [s0, user(u2)]],
                         n_ctx=512, max_tokens=12, **SAMPLED)
    assert a2 != alone  # else this test could not tell whether the history was sent
    a3, a4 = expected(tiny, [[s1, user(u1), assistant(a1), user(u2), assistant(a2), user(u3)], [s1, user(u2)]],
                      n_ctx=512, max_tokens=12, **SAMPLED)
    # stdout: the answers only, one line break after each; the commands went nowhere near the model
    assert out == a1 + "\n" + a2 + "\n" + a3 + "\n" + a4 + "\n"
    assert "unknown command /bogus" in err and "/reset" in err and "/help" in err
    assert f"system: {sys1}" in err and "tok/s" not in err  # piped: no stats line


def test_thinking_is_shown_apart_and_not_kept(tmp_path):
    """A template that thinks: the thinking goes to stderr, the answer to stdout, and only the
    answer goes back to the model in the next turn's history."""
    from test_reasoning import OPENS
    thinker = str(write_tiny(tmp_path / "thinker.gguf", chat_template=OPENS))
    u1, u2 = "Hello there", "And then?"
    kw = dict(max_tokens=32, reasoning_budget=6, **SAMPLED)
    r = chat(thinker, [u1, u2], "--max-tokens", "32", "--reasoning-budget", "6", "--temperature", "3",
             "--seed", "1", "--n-ctx", "512")
    assert r.returncode == 0, r.stderr.decode()

    async def go():
        async with Session.open(thinker, n_ctx=512) as s:
            c1 = await s.generate(messages=[user(u1)], **kw)
            c2 = await s.generate(messages=[user(u1), assistant(c1.text), user(u2)], **kw)
            kept = await s.generate(messages=[user(u1), assistant(c1.reasoning + c1.text), user(u2)], **kw)
            return c1, c2, kept
    c1, c2, kept = anyio.run(go)
    assert c1.reasoning and c1.text and kept.text != c2.text  # the test tells the two histories apart
    assert r.stdout.decode() == c1.text + "\n" + c2.text + "\n"
    assert r.stderr.decode() == f"[thinking] {c1.reasoning}\n[thinking] {c2.reasoning}\n"


def test_sigint_stops_the_answer_and_the_chat_goes_on(slow):
    """SIGINT mid-answer: the answer stops, its part so far stays in the history (the next answer
    is the one for that conversation), and EOF then exits 0."""
    u1, u2 = "Tell me a long story", "And then?"
    p = subprocess.Popen(args(slow, "--temperature", "3", "--seed", "1", "--n-ctx", "512"),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    pipes = Pipes(p)
    try:
        p.stdin.write((u1 + "\n").encode())
        p.stdin.flush()
        pipes.wait_for("out", lambda b: len(b) >= 16)  # the answer is streaming
        p.send_signal(signal.SIGINT)
        pipes.wait_for("err", lambda b: b"[stopped]" in b)  # written after the answer's last byte
        pipes.drain()
        first, pipes.got["out"] = pipes.got["out"], b""
        rest, err = p.communicate((u2 + "\n").encode(), timeout=60)  # then EOF
        assert p.returncode == 0, (pipes.got["err"] + err).decode()
    finally:
        p.kill()
    partial, rest = first.decode(), (pipes.got["out"] + rest).decode()
    assert partial.endswith("\n")
    partial = partial[:-1]
    full, a2 = expected(slow, [[user(u1)], [user(u1), assistant(partial), user(u2)]], n_ctx=512, **SAMPLED)
    assert len(full) > 100 and full.startswith(partial) and len(partial) < len(full) // 2  # stopped early
    assert rest == a2 + "\n"


def test_context_overflow_is_a_message_not_a_crash(tiny):
    """A turn that does not fit is refused with advice and dropped from the history; /reset
    makes room again; /exit leaves with the lines after it unread."""
    z = "z" * 25  # fits alone in 64 tokens, not after a turn of history
    r = chat(tiny, ["x" * 100, "Hi", z, "/reset", z, "/exit", "not read"], "--n-ctx", "64", "--max-tokens", "8", "--temperature", "3",
             "--seed", "1")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert err.count("no longer fits the context of 64 tokens") == 2 and "/reset to start over" in err
    assert "Traceback" not in err
    hi, zz = expected(tiny, [[user("Hi")], [user(z)]], n_ctx=64, max_tokens=8, **SAMPLED)
    assert r.stdout.decode() == hi + "\n" + zz + "\n"


def test_ctrl_c_on_a_terminal(slow):
    """Under a pty: the prompt, a stats line after an answer, Ctrl-C (^C through the terminal's
    line discipline) stops a streaming answer and returns to the prompt; Ctrl-C at the prompt
    ends the program with 130."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        try:
            os.chdir(ROOT)
            os.execv(sys.executable, args(slow, "--n-ctx", "512", "--temperature", "0"))
        finally:
            os._exit(127)
    term = PtyReader(fd)
    try:
        term.wait_for(b"> ")
        os.write(fd, b"Hi\n")
        term.wait_for(b"tok/s")
        term.wait_for(b"> ")
        os.write(fd, b"/reset\n")  # the answer filled the context
        term.wait_for(b"cleared")
        term.wait_for(b"> ")
        os.write(fd, b"Tell me a long story\n")
        term.wait_for(b"story\r\n\r\n\r\n")  # its echo, then the answer's first line breaks
        os.write(fd, b"\x03")
        term.wait_for(b"[stopped]")
        term.wait_for(b"> ")
        os.write(fd, b"\x03")
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 130, term.seen.decode(errors="replace")
    assert b"\x1b[2m[" in term.seen and b"Traceback" not in term.seen


class Pipes:
    """A child's stdout and stderr, read in this thread: once stderr shows something the child
    wrote after flushing stdout, drain() holds all of stdout up to then."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.fds = {p.stdout.fileno(): "out", p.stderr.fileno(): "err"}
        self.got = {"out": b"", "err": b""}

    def _pump(self, timeout: float) -> bool:
        ready, _, _ = select.select(list(self.fds), [], [], timeout)
        for fd in ready:
            self.got[self.fds[fd]] += os.read(fd, 65536)
        return bool(ready)

    def wait_for(self, name: str, ok, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not ok(self.got[name]):
            if not self._pump(max(end - time.monotonic(), 0)) and time.monotonic() >= end:
                raise AssertionError(f"not seen in time; {name} has {self.got[name][-500:]!r}")

    def drain(self) -> None:
        while self._pump(0) and any(self.got.values()):
            pass


class PtyReader:
    def __init__(self, fd: int) -> None:
        self.fd, self.seen, self._at = fd, b"", 0

    def wait_for(self, pattern: bytes, timeout: float = 60) -> None:
        """Until `pattern` appears after what an earlier wait_for matched."""
        end = time.monotonic() + timeout
        while (i := self.seen.find(pattern, self._at)) < 0:
            ready, _, _ = select.select([self.fd], [], [], max(end - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"{pattern!r} not seen; got {self.seen[-500:]!r}")
            try:
                self.seen += os.read(self.fd, 65536)
            except OSError:  # the child is gone
                raise AssertionError(f"{pattern!r} not seen; got {self.seen[-500:]!r}") from None
        self._at = i + len(pattern)
