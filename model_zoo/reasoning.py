"""Thinking apart from the answer, for chat templates that think. Detected from the template, as
llama.cpp's chat code does (common/chat.cpp), never from the model's name:
- "think": `<think>...</think>` (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and its distills, SmolLM3). The
  generation prompt may open `<think>` itself (DeepSeek-R1, Qwen3.5: the output starts inside the
  thinking), or the model opens it (Qwen3).
- "gemma4": Gemma 4, `<|channel>thought\n...<channel|>` then the answer (with thinking off, the
  generation prompt holds an empty one, closed).
- "harmony": gpt-oss. `<|channel|>analysis<|message|>...<|end|>` is the thinking, the answer comes
  after `<|channel|>final<|message|>`; special tokens are rendered as text, so both are text here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkFormat:
    name: str
    open: str    # the marker that starts the thinking
    close: str   # the marker that ends it
    answer: str  # what starts the answer after `close` ("": it follows at once)
    feed_close: str  # fed as tokens to end the thinking early (reasoning_budget)
    call: str = ""   # after the thinking, what starts a tool call (handed on as answer text)


THINK = ThinkFormat("think", "<think>", "</think>", "", "\n</think>\n\n")
GEMMA4 = ThinkFormat("gemma4", "<|channel>thought\n", "<channel|>", "", "<channel|>")
HARMONY = ThinkFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", "<|channel|>final<|message|>",
                      "<|end|><|start|>assistant<|channel|>final<|message|>", "to=functions.")


def detect(template: str | None) -> ThinkFormat | None:
    """The template's thinking format, or None where it does not think."""
    if not isinstance(template, str):
        return None
    if "<|channel|>" in template and "analysis" in template:
        return HARMONY
    if "<|channel>" in template and "<channel|>" in template:
        return GEMMA4
    if "<think>" in template or "</think>" in template:
        return THINK
    return None


def opened_by_prompt(fmt: ThinkFormat, prompt_tail: str) -> bool:
    """Whether the rendered generation prompt ends inside the thinking (`...<think>\\n`)."""
    tail = prompt_tail.rstrip()
    return tail.endswith("<|channel|>analysis<|message|>") if fmt is HARMONY else tail.endswith(fmt.open.rstrip())


class ReasoningSplitter:
    """Streamed text in, (reasoning, answer) pieces out. Text that may be the start of a marker
    is held back until the next piece tells. Before the thinking opens, only whitespace may
    precede its marker; anything else means the model answers without thinking."""

    def __init__(self, fmt: ThinkFormat, *, opened: bool) -> None:
        self.fmt = fmt
        self.state = "think" if opened else "start"  # start -> think -> between -> answer
        self.buf = ""

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        self.buf += text
        think, answer = [], []
        while True:
            f, b = self.fmt, self.buf
            if self.state == "start":
                s = b.lstrip()
                if s.startswith(f.open):
                    self.state, self.buf = "think", s[len(f.open):]
                    continue
                if not final and (not s or f.open.startswith(s)):
                    break  # could still be the opening marker
                if f.answer and f.answer in b:  # harmony without an analysis channel
                    self.state, self.buf = "answer", b[b.index(f.answer) + len(f.answer):]
                    continue
                if f.answer and not final and _holds_prefix(b, f.answer):
                    break
                self.state = "answer"
                continue
            if self.state == "think":
                i = b.find(f.close)
                if i >= 0:
                    think.append(b[:i])
                    self.state, self.buf = "between", b[i + len(f.close):]
                    continue
                keep = 0 if final else _partial(b, f.close)
                think.append(b[:len(b) - keep])
                self.buf = b[len(b) - keep:]
                break
            if self.state == "between":  # whitespace, or harmony's header up to the final channel
                if f.answer:
                    i = b.find(f.answer)
                    call = b.find(f.call) if f.call else -1
                    if call >= 0 and (i < 0 or call < i):  # a tool call instead of an answer: the tool parser's
                        self.state = "answer"
                        continue
                    if i < 0:
                        if final:
                            self.buf = ""
                        break
                    self.state, self.buf = "answer", b[i + len(f.answer):]
                    continue
                s = b.lstrip()
                if not s and not final:
                    break
                self.state, self.buf = "answer", s
                continue
            answer.append(b)  # answer
            self.buf = ""
            break
        return "".join(think), "".join(answer)


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of text that is a proper start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _holds_prefix(text: str, marker: str) -> bool:
    return _partial(text, marker) > 0
