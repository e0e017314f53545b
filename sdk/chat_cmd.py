"""`hearthlm chat [--model M]`: a chat in the terminal. Each input line is a user turn; the whole
conversation (system, user, assistant messages) goes to `Session.stream(messages=...)` and the
answer streams to stdout. stdout carries the answers only, a line break after each, so a piped
run's output is just the answers; thinking (Chunk.reasoning, never kept in the history), notes
and errors go to stderr, dimmed on a terminal, where a line of tokens and tok/s follows each
answer. EOF, /exit and /quit exit 0. Ctrl-C while an answer streams stops it (the stream is left,
so the engine aborts the request; the partial answer stays in the history); Ctrl-C at the prompt,
or a second one before the first has stopped the answer, exits 130 (the shell's code for an
interrupt). SIGINT goes to the event loop (loop.add_signal_handler), never a KeyboardInterrupt."""
from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
from contextlib import aclosing, nullcontext
from pathlib import Path

import anyio

from hearthlm._wake import Channel, loop_waker
from hearthlm.core.errors import ContextLengthError, HearthError, SessionClosedError
from hearthlm.options import from_args
from hearthlm.session import Session

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
COMMANDS = "/reset, /system [TEXT], /image PATH, /help, /exit"
HELP = """\
  /reset         clear the conversation (the system message stays)
  /system TEXT   set the system message; /system alone shows it
  /image PATH    attach an image to the next message (models with a vision projector; repeatable)
  /help          this text
  /exit, /quit   leave (so do EOF and Ctrl-C at the prompt)
Ctrl-C while an answer streams stops it; the partial answer stays in the conversation.
A line starting with // is sent with one / less."""


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="the system message to begin with")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="at most this many tokens an answer (default: until the model stops or the context is full)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--reasoning-budget", type=int, default=None,
                   help="tokens of thinking before the answer begins (templates that think; 0: none)")


def run_chat(a: argparse.Namespace) -> int:
    """The exit code: 0 (EOF, /exit), 130 (Ctrl-C at the prompt), 1 (the engine stopped)."""
    try:  # readline changes the terminal's modes while it reads: an exit mid-line would leave them
        import termios
        saved = termios.tcgetattr(sys.stdin.fileno()) if sys.stdin.isatty() else None
    except (ImportError, OSError):
        saved = None
    try:
        return anyio.run(_chat, a)
    finally:
        if saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)


async def _chat(a: argparse.Namespace) -> int:
    async with Session.open(a.model, options=from_args(a)) as s:
        sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed,
                        reasoning_budget=a.reasoning_budget, adapters={n: 1.0 for n in s.adapters} or None)
        chat = Chat(s, a.system, sampling)
        # Windows' asyncio has no add_signal_handler: there Ctrl-C ends the program (KeyboardInterrupt)
        sigint = anyio.open_signal_receiver(signal.SIGINT) if os.name == "posix" else nullcontext(None)
        with sigint as signals:
            async with anyio.create_task_group() as tg:
                if signals is not None:
                    tg.start_soon(chat.watch_sigint, signals, tg.cancel_scope)
                await chat.run(Lines())
                tg.cancel_scope.cancel()
        return chat.code


class Chat:
    def __init__(self, s: Session, system: str | None, sampling: dict) -> None:
        self.s, self.system, self.sampling = s, system, sampling
        self.turns: list[dict] = []  # user and assistant messages, in order
        self.images: list = []  # /image attachments for the next message
        self.code = 0
        self._answer: anyio.CancelScope | None = None  # set while an answer streams
        self._stats = sys.stdout.isatty()

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    async def watch_sigint(self, signals, main: anyio.CancelScope) -> None:
        async for _ in signals:
            if self._answer is not None and not self._answer.cancel_called:
                self._answer.cancel()  # leaving the stream aborts the request in the engine
            else:
                _note("", dim=False)  # the shell's prompt on a line of its own
                self.code = 130
                main.cancel()

    async def run(self, lines: "Lines") -> None:
        while (line := await lines.read()) is not None:
            line = line.strip()
            if line.startswith("/") and not line.startswith("//"):
                if not self.command(line):
                    return
            elif line and not await self.answer(line[1:] if line.startswith("//") else line):
                self.code = 1
                return

    def command(self, line: str) -> bool:
        """Run a /command; False: leave."""
        cmd, _, arg = line.partition(" ")
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            self.turns.clear()
            _note("(conversation cleared" + (", system message kept)" if self.system else ")"))
        elif cmd == "/system" and arg.strip():
            self.system = arg.strip()
            _note("(system message set)")
        elif cmd == "/system":
            _note(f"system: {self.system}" if self.system else "(no system message)")
        elif cmd == "/image":
            self.attach(arg.strip())
        elif cmd == "/help":
            _note(HELP)
        else:
            _note(f"unknown command {cmd}; commands: {COMMANDS}")
        return True

    def attach(self, path: str) -> None:
        if not path:
            _note("usage: /image PATH")
        elif getattr(self.s, "vision", None) is None:
            _note("this model has no vision projector (mmproj): it cannot see images")
        elif not Path(path).expanduser().is_file():
            _note(f"no such file: {path}")
        else:
            self.images.append(Path(path).expanduser())
            _note(f"(image {len(self.images)} attached to the next message)")

    async def answer(self, text: str) -> bool:
        """Stream one answer and keep it in the history; False: the engine is gone."""
        images, self.images = self.images, []
        parts = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": text}]
        self.turns.append({"role": "user", "content": parts if images else text})
        out, last = Output(), None
        t0 = time.perf_counter()
        try:
            with anyio.CancelScope() as self._answer:
                async with aclosing(self.s.stream(messages=self.messages(), **self.sampling)) as stream:
                    async for c in stream:
                        out.take(c)
                        last = c
        except ContextLengthError as e:
            self.turns.pop()
            out.end(failed=True)
            _note(f"the conversation no longer fits the context of {self.s.n_ctx} tokens ({e}): "
                  "/reset to start over, or run with a larger --n-ctx", dim=False)
            return True
        except SessionClosedError as e:
            out.end(failed=True)
            _note(f"error: {e}", dim=False)
            return False
        except Exception as e:  # noqa: BLE001 - a chat goes on after a failed answer
            self.turns.pop()
            out.end(failed=True)
            _note(f"error: {type(e).__name__ + ': ' if not isinstance(e, HearthError) else ''}{e}", dim=False)
            return True
        finally:
            stopped, self._answer = self._answer is not None and self._answer.cancelled_caught, None
        out.end()
        if stopped and not out.answer:
            self.turns.pop()  # stopped before the answer began: as if never asked
        else:
            self.turns.append({"role": "assistant", "content": "".join(out.answer)})
        if stopped:
            _note("[stopped]")
        elif last is not None and last.finish_reason == "length" and self.sampling["max_tokens"] is None:
            _note("[the context is full: /reset to start over]")
        if self._stats and out.tokens:
            _note(out.stats(t0, last.prompt_tokens if last is not None else None, self.s.n_ctx))
        return True


class Output:
    """One answer on its way to the terminal: the answer's text to stdout, thinking to stderr."""

    def __init__(self) -> None:
        self.answer: list[str] = []
        self.tokens, self.first = 0, None
        self._thinking = False
        self._dim = sys.stderr.isatty()

    def take(self, c) -> None:
        self.tokens += len(c.token_ids)
        self.first = self.first or time.perf_counter()
        if c.reasoning:
            if not self._thinking:
                self._thinking = True
                sys.stderr.write(DIM if self._dim else "[thinking] ")
            sys.stderr.write(c.reasoning)
            sys.stderr.flush()
        if c.text:
            self._end_thinking()
            self.answer.append(c.text)
            sys.stdout.write(c.text)
            sys.stdout.flush()

    def _end_thinking(self) -> None:
        if self._thinking:
            self._thinking = False
            sys.stderr.write((PLAIN if self._dim else "") + "\n")
            sys.stderr.flush()

    def end(self, *, failed: bool = False) -> None:
        """Close the answer's line (a failed one's only where it began)."""
        self._end_thinking()
        if self.answer or not failed:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def stats(self, t0: float, prompt_tokens: int | None, n_ctx: int) -> str:
        rate = (self.tokens - 1) / (time.perf_counter() - self.first) if self.tokens > 1 else 0.0
        ctx = f", context {prompt_tokens + self.tokens}/{n_ctx}" if prompt_tokens else ""
        return f"[{self.tokens} tokens, {rate:.1f} tok/s, first after {self.first - t0:.2f} s{ctx}]"


class Lines:
    """stdin lines, read in a daemon thread one at a time when asked, so the event loop never
    blocks on input and an exit never waits for a line (anyio's worker threads are joined at
    exit). On a terminal input() reads (readline's editing); otherwise raw reads of fd 0, which
    hold no lock of sys.stdin's that the interpreter's shutdown would wait for."""

    def __init__(self) -> None:
        self._asks: queue.SimpleQueue = queue.SimpleQueue()
        self._got = Channel(loop_waker())
        self._terminal = sys.stdin.isatty() and sys.stdout.isatty()
        if self._terminal:
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
        threading.Thread(target=self._run, name="hearthlm-chat-input", daemon=True).start()

    async def read(self) -> str | None:
        """The next line, None at EOF."""
        self._asks.put(None)
        return (await self._got.get_all())[0]

    def _run(self) -> None:
        raw = None if self._terminal else _raw_lines(sys.stdin.fileno())
        while True:
            self._asks.get()
            if raw is not None and sys.stdin.isatty():
                sys.stderr.write("> ")  # stdout is piped: the prompt goes to the terminal
                sys.stderr.flush()
            try:
                line = input("> ") if raw is None else next(raw, None)
            except EOFError:
                line = None
            self._got.put(line)
            if line is None:
                return


def _raw_lines(fd: int):
    buf = b""
    while True:
        while b"\n" not in buf:
            data = os.read(fd, 65536)
            if not data:
                if buf:
                    yield buf.decode("utf-8", "replace")
                return
            buf += data
        line, buf = buf.split(b"\n", 1)
        yield line.decode("utf-8", "replace")


def _note(text: str, *, dim: bool = True) -> None:
    """A line that is not the answer: to stderr, dimmed on a terminal."""
    dim = dim and sys.stderr.isatty()
    sys.stderr.write(f"{DIM}{text}{PLAIN}\n" if dim else text + "\n")
    sys.stderr.flush()

