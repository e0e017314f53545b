"""Fuzz target: the chat template renderer (render_chat, encode_chat) with arbitrary messages
and arbitrary templates: ones built from a grammar of Jinja constructs (loops, macros,
filters, sets, namespaces, sandbox probes, huge numbers), real templates with a generated
statement spliced in, and raw text. A template comes from a model file: it is hostile input.

Oracles beyond "a result or a HearthError": the output is a str with no sign of a sandbox
escape (a module or os object rendered); encode_chat's ids lie in the vocab; under ChatML,
message contents never add turn markers (no token injection).
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

from fuzz.engine import Draw
from hearthlm.model_zoo.chat_template import encode_chat, render_chat

NAME = "template"
MAX_LEN = 4096
TEMPLATES = Path(__file__).resolve().parents[2] / "model_zoo" / "templates"
warnings.filterwarnings("ignore", category=SyntaxWarning)  # Python compiling a template's `1[0]`

_INTS = [0, 1, 2, -1, 3, 7, 10, 100, 1000, 100000, 10**6, 2**31, 2**63, 10**9, 10**20]
_STRS = ["", "a", "user", "assistant", "system", "content", "role", "<|im_start|>", "<|im_end|>", "\n",
         "%s", "{0}", "{0:>99999999}", "%099999999d", "%*d", "%.*f", "{:{}}", "{0:{1}}",
         "\x00hearthlm-msg-0\x00", "\u00e9\U0001F642", "\ud800",
         "'", '"', "\\", "{{", "{%", "__class__", "os", "mro", "x" * 100]
_VARS = ["messages", "m", "message", "x", "y", "ns", "loop", "bos_token", "eos_token", "add_generation_prompt",
         "tools", "nothing", "range", "lipsum", "dict", "cycler", "joiner", "namespace", "raise_exception",
         "strftime_now", "self", "caller", "varargs", "kwargs", "f"]
_ATTRS = ["role", "content", "name", "tool_calls", "items", "keys", "values", "get", "split", "strip",
          "startswith", "upper", "format", "format_map", "join", "replace", "append", "update", "pop", "index",
          "count", "first", "index0", "length", "last", "cycle", "revindex", "depth", "__class__", "__mro__",
          "__subclasses__", "__globals__", "__init__", "__builtins__", "__dict__", "__self__", "__func__",
          "__base__", "__getitem__", "mro", "func_globals", "gi_frame", "f_globals", "_TemplateReference__context",
          "environment", "module", "real", "x"]
_FILTERS = ["upper", "lower", "trim", "tojson", "tojson(indent=N)", "length", "join(', ')", "replace('a', E)",
            "list", "first", "last", "default(E)", "int", "float", "string", "items", "selectattr('role', 'equalto', 'user')",
            "rejectattr('content')", "map(attribute='content')", "batch(N)", "slice(N)", "wordwrap(N)", "center(N)",
            "indent(N)", "truncate(N)", "reverse", "sort", "unique", "dictsort", "sum", "max", "min", "round", "abs",
            "format(E)", "safe", "escape", "striptags", "title", "capitalize", "count", "attr(E)", "filesizeformat",
            "pprint", "urlencode", "xmlattr", "groupby('role')", "wordcount", "urlize", "random", "join(E)",
            "map('upper')", "sum(start=E)", "list|join"]
_TESTS = ["defined", "undefined", "none", "string", "mapping", "iterable", "number", "odd", "even",
          "divisibleby(N)", "sameas(E)", "equalto(E)", "in(E)", "callable", "true", "false", "lower"]
_OPS = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", ">=", "and", "or", "in", "not in"]
_CALLS = ["range(N)", "range(N, N, N)", "lipsum(N)", "dict(a=E)", "namespace(a=E)", "cycler(E, E)", "joiner(E)",
          "raise_exception(E)", "strftime_now(E)", "E.split(E)", "E.format(E)", "E.items()", "E.get(E)",
          "E.__class__.__mro__[1].__subclasses__()", "E.__init__.__globals__", "E.append(E)", "E.pop()",
          "self.__init__()", "f(E)", "f(E, E)", "E.count(E)", "E.join(E)", "loop.cycle(E, E)", "E.mro()"]
_TEXTS = ["", "\n", "<|im_start|>", "<|im_end|>\n", "hi ", "{", "}", "%", "#", "\u00e9", "<start_of_turn>", "  \n  "]


class Grammar:
    """Draws Jinja source text; every choice comes from the fuzzer's bytes."""

    def __init__(self, d: Draw):
        self.d, self.loops = d, 0

    def fill(self, spec: str, depth: int) -> str:
        out = []
        for ch in spec:  # N: a number, E: an expression
            out.append(self.num() if ch == "N" else self.expr(depth + 1) if ch == "E" else ch)
        return "".join(out)

    def num(self) -> str:
        return str(self.d.pick(_INTS))

    def expr(self, depth: int = 0) -> str:
        d = self.d
        k = d.int(14 if depth < 3 else 3)
        if k == 0:
            return self.num()
        if k == 1:
            return repr(d.pick(_STRS))
        if k == 2:
            return d.pick(_VARS)
        if k == 3:
            return f"({self.expr(depth + 1)}).{d.pick(_ATTRS)}"
        if k == 4:
            idx = d.pick(["N", "-1", "E", "'content'", "'role'", "1:", "::-1", "N:N"])
            return f"{self.expr(depth + 1)}[{self.fill(idx, depth)}]"
        if k == 5:
            return f"({self.expr(depth + 1)} {d.pick(_OPS)} {self.expr(depth + 1)})"
        if k == 6:
            return f"({self.expr(depth + 1)} | {self.fill(d.pick(_FILTERS), depth)})"
        if k == 7:
            return self.fill(d.pick(_CALLS), depth)
        if k == 8:
            items = ", ".join(self.expr(depth + 1) for _ in range(d.int(3)))
            return d.pick([f"[{items}]", f"({items},)", "{" + f"'k': {self.expr(depth + 1)}" + "}"])
        if k == 9:
            return f"({self.expr(depth + 1)} if {self.expr(depth + 1)} else {self.expr(depth + 1)})"
        if k == 10:
            return f"({self.expr(depth + 1)} is {'not ' if d.bool() else ''}{self.fill(d.pick(_TESTS), depth)})"
        if k == 11:
            return f"(not {self.expr(depth + 1)})"
        if k == 12:
            return "messages[0]['content']"
        return d.pick(["messages[-1].role", "loop.index", "ns.x", "(message['content'] | trim)", "m.content"])

    def tag(self, body: str) -> str:
        d = self.d
        return f"{{%{'-' if d.bool() else ''} {body} {'-' if d.bool() else ''}%}}"

    def block(self, depth: int) -> str:
        return "".join(self.stmt(depth + 1) for _ in range(self.d.int(4 if depth < 3 else 2)))

    def stmt(self, depth: int = 0) -> str:
        d, t = self.d, self.tag
        k = d.int(13 if depth < 4 else 3)
        if k == 0:
            return d.pick(_TEXTS)
        if k in (1, 2):
            return f"{{{{ {self.expr()} }}}}"
        if k == 3:
            self.loops += 1
            var = d.pick(["m", "message", "x", "(k, v)"])
            head = f"for {var} in {self.expr()}" + (f" if {self.expr()}" if d.int(4) == 0 else "") + \
                (" recursive" if d.int(6) == 0 else "")
            body = self.block(depth) + (f"{{{{ loop({self.expr()}) }}}}" if "recursive" in head else "")
            other = t("else") + self.block(depth) if d.int(4) == 0 else ""
            self.loops -= 1
            return t(head) + body + other + t("endfor")
        if k == 4:
            out = t(f"if {self.expr()}") + self.block(depth)
            for _ in range(d.int(3)):
                out += t(f"elif {self.expr()}") + self.block(depth)
            return out + (t("else") + self.block(depth) if d.bool() else "") + t("endif")
        if k == 5:
            target = d.pick(["x", "y", "ns", "ns.x", "m", "messages"])
            if d.int(3) == 0:
                return t(f"set {target.split('.')[0]}") + self.block(depth) + t("endset")
            return t(f"set {target} = {self.expr()}")
        if k == 6:  # a macro, maybe recursive, and a call of it
            return t("macro f(n, y=1)") + self.block(depth) + t("endmacro") + f"{{{{ f({self.expr()}) }}}}"
        if k == 7:
            return t(d.pick(["break", "continue"])) if self.loops else t("set ns = namespace(x=0)")
        if k == 8:
            return d.pick(["{% raw %}{{ x }}{% endraw %}", "{# " + d.pick(_TEXTS) + " #}", "{% include 'x' %}",
                           "{% import 'x' as y %}", "{% extends 'x' %}", "{% from 'x' import y %}"])
        if k == 9:
            return t("generation") + self.block(depth) + t("endgeneration")
        if k == 10:
            return t(f"filter {d.pick(['upper', 'trim', 'center(N)', 'indent(N)'])}".replace("N", self.num())) + \
                self.block(depth) + t("endfilter")
        if k == 11:
            return t("macro f(n)") + "{{ caller() }}" + t("endmacro") + t(f"call f({self.expr()})") + \
                self.block(depth) + t("endcall")
        return t(f"with x = {self.expr()}") + self.block(depth) + t("endwith")


@functools.lru_cache(maxsize=1)
def real_templates() -> tuple[str, ...]:
    from tiny_gguf import CHATML
    found = [CHATML] + [p.read_text() for p in sorted(TEMPLATES.glob("*.jinja"))]
    try:  # SmolLM2's own template, where the model is installed
        from hearthlm.model_zoo.gguf_file import GGUFFile
        from hearthlm.model_zoo.resolve import resolve_model
        with GGUFFile.open(resolve_model("smollm2-135m-instruct", offline=True)) as f:
            found.append(f.get("tokenizer.chat_template"))
    except Exception:
        pass
    return tuple(t for t in found if isinstance(t, str))


def draw_template(d: Draw) -> tuple[str, str]:
    mode = d.int(4)
    if mode < 2:
        g = Grammar(d)
        return "grammar", "".join(g.stmt() for _ in range(1 + d.int(5)))
    if mode == 2:  # a real template with a generated statement at one of its tag boundaries
        src = d.pick(real_templates())
        cuts = [i for i in range(len(src)) if src.startswith("{%", i) or src.startswith("{{", i)] or [0]
        at = d.pick(cuts)
        return "spliced", src[:at] + Grammar(d).stmt() + src[at:]
    return "raw", d.bytes(d.int(MAX_LEN)).rstrip(b"\0").decode("utf-8", "replace")


def draw_text(d: Draw) -> str:
    from fuzz.tokenizer_target import _CHUNKS
    return "".join(d.pick(_CHUNKS + _TEXTS) * d.pick([1, 1, 2, 50]) for _ in range(d.int(6)))


def draw_messages(d: Draw):
    if d.int(16) == 15:
        return d.pick([[], None, "hi", {"role": "user", "content": "hi"}, [None], [{"role": "user"}]])
    msgs = []
    for _ in range(d.pick([1, 1, 2, 3, 4, 6])):
        m = {"role": d.pick(["user", "assistant", "system", "tool", "", "model"]), "content": draw_text(d)}
        j = d.int(12)
        if j == 0:
            m["content"] = d.pick([None, 7, ["text"], [{"type": "text", "text": "hi"}], {"a": 1}])
        elif j == 1:
            m["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
        elif j == 2:
            m["name"] = draw_text(d)
        elif j == 3:  # callers may pass roles through from their users too
            m["role"] = d.pick(["user", ""]) + d.pick(_TEXTS) + draw_text(d)
        msgs.append(m)
    return msgs


ESCAPE_SIGNS = ("<module '", "_wrap_close", "<class 'os.", "<class 'subprocess.", "<built-in function system")


def warm() -> None:
    """The tokenizers, real vocabularies included, loaded before the first input is measured."""
    from fuzz.tokenizer_target import tokenizers
    tokenizers()


def case(data: bytes) -> tuple[str, Callable[[], None]]:
    """One input decoded: what it does (for a finding's report) and a thunk that does it, so
    that describing a hang does not run it again."""
    from tiny_gguf import CHATML

    from fuzz.tokenizer_target import tokenizers
    d = Draw(data)
    op = d.int(3)
    if op == 2:  # ChatML: contents must not add or close turns, whatever they hold
        tok, msgs = dict(tokenizers())["bpe-gpt2"], draw_messages(d)

        def run() -> None:
            ids = encode_chat(tok, CHATML, msgs)
            start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
            assert ids.count(start) == len(msgs) + 1 and ids.count(end) == len(msgs), f"turn markers injected: {ids}"
        return f"encode_chat(bpe-gpt2, CHATML, {msgs!r})", run
    kind, template = draw_template(d)
    msgs, gen = draw_messages(d), d.bool()
    what = f"{kind} template:\n{template}\nmessages={msgs!r}, add_generation_prompt={gen}\n"
    if op == 0:
        tools = d.pick([None, [], [{"type": "function", "function": {"name": "f", "parameters": {}}}]])

        def run() -> None:
            out = render_chat(template, msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>", tools=tools)
            assert isinstance(out, str), type(out)
            assert not any(s in out for s in ESCAPE_SIGNS), out[:2000]
        return what + f"render_chat(tools={tools!r})", run
    name, tok = d.pick(tokenizers()[:3])

    def run() -> None:
        ids = encode_chat(tok, template, msgs, add_generation_prompt=gen)
        assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids), ids
    return what + f"encode_chat with tokenizer {name}", run


def one_input(data: bytes) -> None:
    case(data)[1]()


def describe(data: bytes) -> str:
    what = case(data)[0]
    return what if len(what) < 16000 else what[:16000] + "..."


def seeds() -> list[bytes]:
    return [bytes([op, mode]) + b"\x03\x01\x02\x05\x04\x06\x07\x08" for op in range(3) for mode in range(4)] + \
        [bytes([0, 3]) + t.encode() for t in real_templates()]
