"""Bounds on rendering a chat template, which is untrusted data from the model file: the
sandbox keeps it away from Python internals, these keep it from hanging the process or
exhausting its memory. Each is far above what a real template reaches.

- time and steps: a trace function counts the lines the template's own code runs (loop
  iterations, statements, macro calls) and checks the clock; other frames run untraced;
- sizes: a string or sequence the template builds is checked where it is built (`~`, `+`,
  `*`, `%`, `**`, every call and filter), before the work where its size is known up front;
- output: the rendered text is counted as it is produced.
Exceeding any raises TemplateLimitError (an InvalidRequestError) naming the limit."""
from __future__ import annotations

import functools
import math
import operator
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hearthlm.core.errors import InvalidRequestError

TEMPLATE_FILE = "<template>"  # the filename Jinja compiles templates under


class TemplateLimitError(InvalidRequestError):
    pass


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 1.0            # wall time of one render
    steps: int = 1_000_000          # lines of template code run (a 2,000-message chat takes ~50,000)
    output_chars: int = 4_000_000   # the rendered prompt
    value_len: int = 4_000_000      # any string, list or dict the template builds
    template_chars: int = 1_000_000  # the template itself (real ones are under 50,000)


DEFAULT_LIMITS = TemplateLimits()
# a %- or {}-format field 100,000+ wide or precise, or one whose width comes from the arguments
# (`%*d`, `%.*f`, `{:{}}`): its size is unknown until the string is built
_WIDE_FORMAT = re.compile(r"%[-+ #0]*(\d*\.?\d{6,}|\*|\d*\.\*)|\{[^{}]*:[^{}]*?(\d{6,}|\{)")


class Budget:
    """One render's allowance; `trace` is installed with sys.settrace on the rendering thread."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = self.calls = 0
        self.deadline = time.monotonic() + limits.seconds

    def trace(self, frame, event, arg):  # the global tracer: line events only in template code
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return self._line
        self.calls += 1  # other Python code the template runs (a filter's loop) meets the clock here
        if self.calls & 63 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template took longer than {self.limits.seconds} s to render")
        return None

    def _line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > self.limits.steps:
                raise TemplateLimitError(f"chat template ran more than {self.limits.steps} steps (a runaway loop?)")
            if self.steps & 255 == 0 and time.monotonic() > self.deadline:
                raise TemplateLimitError(f"chat template took longer than {self.limits.seconds} s to render")
        return self._line

    def check(self, value: Any) -> Any:
        """`value`, once it is known to be within the size limit."""
        n = len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, range)) else 0
        if n > self.limits.value_len:
            self.too_big(n)
        return value

    def check_format(self, fmt: Any) -> None:
        if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
            raise TemplateLimitError("chat template formats a field wider than 100,000 characters")

    def check_args(self, name: str, args: tuple, kwargs: dict) -> None:
        """Refuse a filter call whose result would be too big, before it runs: a width or
        count past the limit, and the few filters whose output multiplies their input."""
        lim = self.limits.value_len
        nums = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, int)]
        if any(abs(a) > lim for a in nums):
            self.too_big(max(abs(a) for a in nums))
        value = args[0] if args else None
        text = next((a for a in args[:2] if isinstance(a, str)), "")  # after a passed context, if any
        if name in _SLOW_FILTERS and len(text) > _SLOW_FILTER_CHARS:
            raise TemplateLimitError(f"chat template applies {name[3:]} to {len(text)} characters; "
                                     f"at most {_SLOW_FILTER_CHARS} are taken")
        if name == "do_format":
            self.check_format(value)
        elif name == "do_indent" and isinstance(value, str) and nums:
            self.check(range((value.count("\n") + 1) * max(nums) + len(value)))
        elif name in ("do_join", "sync_do_join") and len(args) > 2 and isinstance(args[2], str) \
                and hasattr(args[1], "__len__"):
            self.check(range(len(args[1]) * len(args[2])))
        elif name == "do_replace" and len(args) > 3 and all(isinstance(a, str) for a in args[1:4]):
            self.check(range(len(args[1]) + (args[1].count(args[2]) if args[2] else len(args[1]) + 1) * len(args[3])))

    def too_big(self, n: int) -> None:
        raise TemplateLimitError(f"chat template built a value of {n} items; the limit is {self.limits.value_len}")


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


class BoundedOps(threading.local):
    """The size-checked operations a sandboxed environment routes through the budget of the
    render running on this thread (environments are shared, renders may run concurrently)."""

    def __init__(self) -> None:
        self.budget: Budget | None = None  # set for the duration of a render

    def binop(self, op: str, left: Any, right: Any) -> Any:
        b = self.budget
        if b is not None:
            if op == "*":
                for seq, k in ((left, right), (right, left)):
                    if _length(seq) and isinstance(k, int) and _length(seq) * k > b.limits.value_len:
                        b.too_big(_length(seq) * k)
            elif op == "+" and _length(left) + _length(right) > b.limits.value_len:
                b.too_big(_length(left) + _length(right))
            elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * math.log2(abs(left)) > 1 << 16:
                raise TemplateLimitError("chat template computed a power beyond 65,536 bits")
            elif op == "%":
                b.check_format(left)
        value = _BINOPS[op](left, right)
        return b.check(value) if b is not None else value

    def join(self, inner: Callable[[Any], str]) -> Callable[[Any], str]:
        """Jinja's `~` (str_join / markup_join), sized before joining."""
        def join(seq):
            b = self.budget
            if b is not None:
                seq = list(seq)
                if sum(len(s) if isinstance(s, str) else 0 for s in seq) > b.limits.value_len:
                    b.too_big(sum(len(s) if isinstance(s, str) else 0 for s in seq))
            return inner(seq)
        return join

    def after(self, fn: Callable) -> Callable:
        """A filter or call whose result is size-checked (format strings first)."""
        @functools.wraps(fn)  # keeps Jinja's pass_context / pass_environment marks
        def call(*args, **kwargs):
            if self.budget is None:  # Jinja folding a constant at compile time: leave it to the render
                from jinja2.nodes import Impossible  # here: `import hearthlm` need not load Jinja
                raise Impossible()
            self.budget.check_args(fn.__name__, args, kwargs)
            value = fn(*args, **kwargs)
            return self.budget.check(value)
        return call


# filters that loop in Python over their input's words (untraced, their memory several times the
# input's): a chat's uses are short texts
_SLOW_FILTERS = frozenset({"do_wordwrap", "do_urlize"})
_SLOW_FILTER_CHARS = 100_000

_BINOPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "//": operator.floordiv, "%": operator.mod, "**": operator.pow}


class bounded:
    """Context manager for one render: `budget` traces this thread's template frames and
    backs `ops`; any previous tracer (a debugger, coverage) is put back after."""

    def __init__(self, ops: BoundedOps, limits: TemplateLimits) -> None:
        self.ops, self.budget = ops, Budget(limits)

    def __enter__(self) -> Budget:
        self._prev = sys.gettrace()
        self.ops.budget = self.budget
        sys.settrace(self.budget.trace)
        return self.budget

    def __exit__(self, *exc) -> None:
        sys.settrace(self._prev)
        self.ops.budget = None
