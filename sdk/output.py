"""One choice's tokens turned into Chunks: whole characters, cut at the first stop string (none
before min_tokens), thinking split from the answer, tool calls held back to the last chunk;
and one choice's Chunks joined into its Completion."""
from __future__ import annotations

from dataclasses import replace

from hearthlm.model_zoo.reasoning import ReasoningSplitter
from hearthlm.model_zoo.tokenizer import StreamDecoder
from hearthlm.tools import ToolOutput
from hearthlm.types import Chunk, Completion


class ChoiceOutput:
    def __init__(self, tokenizer, prompt_ids: list[int], *, index: int, stops: list[str], min_tokens: int,
                 splitter: ReasoningSplitter | None, tools: ToolOutput | None) -> None:
        self.index, self.stops, self.min_tokens = index, stops, min_tokens
        self.decoder = StreamDecoder(tokenizer, prompt_ids=prompt_ids)
        self.splitter, self.tools = splitter, tools
        # held: text that may be the start of a stop string; recent: the text emitted last, as
        # much as a stop string could reach back into (the whole text made the matching quadratic)
        self.recent, self.held, self.keep = "", "", max(map(len, stops), default=0)
        self.n_tokens = 0
        self.done = False
        self.stopped = False  # a stop string ended it: the engine may still be running it
        self.stop_sequence: str | None = None  # which one (Anthropic's stop_sequence)

    def take(self, items: list[tuple]) -> Chunk | None:
        """items: (token, top_logprobs) as they came, maybe ending in (reason, error) when the
        request finished. Returns the chunk to yield, if there is anything to say."""
        toks, lps, new, reason = [], [], "", None
        for a, b in items:
            if self.done:
                break
            if isinstance(a, str):  # finished (errors are raised by the caller)
                reason, self.done = a, True
                # a character cut short by max_tokens is dropped, not shown as U+FFFD
                tail = self.decoder.flush()
                piece, self.held, hit = _cut_at_stop(self.recent + new, self.held + tail.rstrip("\ufffd"),
                                                     self._stops(), final=True)
                new += piece
                reason = "stop" if hit else reason
                self.stop_sequence = hit or None
                break
            # one token at a time: a stop string ends the tokens as well as the text
            toks.append(a)
            self.n_tokens += 1
            if b is not None:
                lps.append(b)
            piece, self.held, hit = _cut_at_stop(self.recent + new, self.held + self.decoder.push(a),
                                                 self._stops(), final=False)
            new += piece
            if hit:
                reason, self.done, self.stopped, self.stop_sequence = "stop", True, True, hit
        self.recent = (self.recent + new)[-self.keep:] if self.keep else ""
        if not (toks or new or self.done):
            return None
        think = ""
        if self.splitter is not None:
            think, new = self.splitter.feed(new, final=self.done)
        c = Chunk(new, toks, reason, lps or None, reasoning=think, index=self.index,
                  stop_sequence=self.stop_sequence if self.done else None)
        return self.tools.feed(c) if self.tools is not None else c

    def _stops(self) -> list[str]:
        # looked for from the token after the min_tokens-th: those tokens' text is all kept
        return self.stops if self.n_tokens > self.min_tokens else []


def with_prompt(c: Chunk, prompt_tokens: int) -> Chunk:
    return replace(c, prompt_tokens=prompt_tokens) if c.finish_reason else c


def _cut_at_stop(before: str, new: str, stops: list[str], *, final: bool) -> tuple[str, str, str]:
    """Split `new` into (emit, hold, hit): cut at the first stop string (hit: that string, "" for
    none; searching across the boundary with `before`), and hold back a tail that could begin one."""
    if not stops:
        return new, "", ""
    window = max(len(s) for s in stops) - 1
    joined = before[-window:] + new if window else new
    offset = len(joined) - len(new)
    cut, hit = min(((i, s) for s, i in ((s, joined.find(s)) for s in stops) if i >= 0), default=(-1, ""))
    if cut >= 0:
        return new[:max(cut - offset, 0)], "", hit
    if final:
        return new, "", ""
    hold = 0
    for s in stops:  # the longest tail of new that begins s: it starts with s[0], within len(s) - 1 of the end
        i = new.find(s[:1], max(len(new) - len(s) + 1, 0)) if s else -1
        while i != -1:
            if s.startswith(new[i:]):
                hold = max(hold, len(new) - i)
                break
            i = new.find(s[0], i + 1)
    return new[:len(new) - hold], new[len(new) - hold:], ""


class ChunkJoin:
    """One choice's chunks joined into its Completion (generate, and each round of act)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.ids: list[int] = []
        self.lps: list = []
        self.reason, self.calls, self.n_prompt, self.stop = "length", None, 0, None

    def add(self, c: Chunk) -> None:
        self.text.append(c.text)
        self.reasoning.append(c.reasoning)
        self.ids.extend(c.token_ids)
        self.lps.extend(c.top_logprobs or ())
        self.reason = c.finish_reason or self.reason
        self.calls = c.tool_calls or self.calls
        self.n_prompt = c.prompt_tokens or self.n_prompt
        self.stop = c.stop_sequence or self.stop

    def completion(self, n_prompt: int | None = None, prompt_logprobs: list | None = None) -> Completion:
        return Completion("".join(self.text), self.ids, self.reason, n_prompt if n_prompt is not None else self.n_prompt,
                          self.lps or None, tool_calls=self.calls, reasoning="".join(self.reasoning),
                          prompt_logprobs=prompt_logprobs, stop_sequence=self.stop)
