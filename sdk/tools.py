"""Tool calling for Session: the prompt (tools rendered by the model's template, or described
in a system message where the template ignores them), the grammar that forces a call for
tool_choice "required" or a named function, and the parsing of the output into OpenAI-shaped
tool_calls (formats per model family: model_zoo/tool_calls.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo import tool_calls as tc
from hearthlm.model_zoo.chat_template import normalize_messages
from hearthlm.types import Chunk


@dataclass
class ToolPlan:
    fmt: tc.ToolFormat
    tools: list[dict]
    choice: str  # "auto", "none", "required" or a function name

    @classmethod
    def make(cls, model: Any, tools: Any, tool_choice: Any) -> "ToolPlan | None":
        if tools is None:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools=")
            return None
        tools, choice = tc.check_tools(tools, tool_choice)
        return cls(tc.tool_format(model.arch_name, model.chat_template), tools, choice)

    def chat(self, messages: list[dict], template: str | None) -> tuple[list[dict], dict]:
        """(messages, template variables) for the prompt. With "none" no tools are offered
        (the model answers in text)."""
        tools = self.tools if self.choice != "none" else None
        if tc.template_renders_tools(template):
            return messages, {"tools": tools} if tools else {}
        return tc.as_hermes_chat(normalize_messages(messages), tools), {}

    def grammar(self, tokenizer) -> str | None:
        """Lark text forcing one call, for "required" and a named function; None otherwise."""
        if self.choice in ("auto", "none"):
            return None
        def special(text: str) -> int | None:
            tid = tokenizer.token_id(text)
            return tid if tid is not None and tokenizer.is_control(tid) else None
        return self.fmt.grammar(self.tools, self.choice, special)


class ToolOutput:
    """Holds back streamed text that may be a tool call; the last chunk carries the calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.fmt, self.active = plan.fmt, plan.choice != "none"
        self.names = frozenset(t["function"]["name"] for t in plan.tools)
        self.text, self.sent = "", 0

    def feed(self, c: Chunk) -> Chunk:
        if not self.active:
            return c
        self.text += c.text
        if c.finish_reason is None:
            safe = max(self.fmt.safe_prefix(self.text), self.sent)
            new, self.sent = self.text[self.sent:safe], safe
            return replace(c, text=new)
        content, calls = self.fmt.parse(self.text, self.names)
        if not calls:
            return replace(c, text=self.text[self.sent:])
        end = min((i for i in (self.text.find(m) for m in self.fmt.markers) if i >= 0), default=self.sent)
        rest = self.text[self.sent:max(end, self.sent)] if content else ""
        return replace(c, text=rest, finish_reason="tool_calls", tool_calls=calls)
