"""Chat templates (GGUF `tokenizer.chat_template`), rendered as HF transformers does.

The template is data from a model file, so it runs in Jinja2's immutable sandbox; any
attempt to reach Python internals, a template bug, or malformed messages becomes an
`InvalidRequestError` that says what went wrong.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from hearthlm.core.errors import ContextLengthError, InvalidRequestError
from hearthlm.model_zoo.template_limits import DEFAULT_LIMITS, BoundedOps, TemplateLimitError, TemplateLimits, bounded
from hearthlm.model_zoo.tokenizer import MEDIA


class _Sandbox(ImmutableSandboxedEnvironment):
    # sizes checked where values are built (template_limits); time and steps by its tracer
    intercepted_binops = frozenset(["+", "*", "%", "**"])

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.ops = BoundedOps()

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return self.ops.binop(operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        budget = __self.ops.budget
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        return budget.check(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:  # `"...".format` reached: refuse huge widths up front
        if self.ops.budget is not None and isinstance(getattr(value, "__self__", None), str):
            self.ops.budget.check_format(value.__self__)
        return super().wrap_str_format(value)

    # Jinja's sandbox answers a forbidden attribute with an Undefined that renders as ""
    # and fails only when used further; refuse at once instead, so an escape is an error.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")

    # A dunder name that happens not to exist is a probe too (`x.__self__`): refuse it
    # rather than render "", unless it is a plain key of a dict the caller passed.
    def getattr(self, obj: Any, attribute: str) -> Any:
        self._refuse_dunder(obj, attribute)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._refuse_dunder(obj, argument)
        return super().getitem(obj, argument)

    def _refuse_dunder(self, obj: Any, name: Any) -> None:
        if isinstance(name, str) and name.startswith("__") and not (
                isinstance(obj, Mapping) and name in obj):
            self.unsafe_undefined(obj, name)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's AssistantTracker): renders its body;
    the assistant-token mask it exists for is of no use at inference."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's tojson: unlike Jinja's own, it does not HTML-escape, so prompts keep < > & '.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template, once per distinct template string."""
    if len(template) > DEFAULT_LIMITS.template_chars:
        raise TemplateLimitError(f"chat template is {len(template)} characters long; "
                                 f"the limit is {DEFAULT_LIMITS.template_chars}")
    # optimized=False: no constant folding at compile time, where filters would run unbounded
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                   extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: env.ops.after(f) for name, f in env.filters.items()}
    del env.globals["lipsum"]  # loops in Jinja's own code for as long as asked: no use to a chat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        t = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"chat template has a syntax error (line {e.lineno}): "
                                  f"{e.message}") from e
    except RecursionError as e:  # deeply nested syntax
        raise InvalidRequestError("chat template is nested too deeply to compile") from e
    except Exception as e:  # Jinja's output that Python refuses (break inside a call block, ...)
        raise InvalidRequestError(f"chat template cannot be compiled: {type(e).__name__}: {e}") from e
    ns = t.root_render_func.__globals__  # the compiled module's: `~` joins through these names
    for name in ("str_join", "markup_join"):
        ns[name] = env.ops.join(ns[name])
    return t


def normalize_messages(messages: Any) -> list[dict]:
    """OpenAI-shaped messages as templates expect them (as transformers and vLLM pass them):
    content given as a list of text parts becomes one string (parts joined by newlines); an
    assistant turn may have content None with `tool_calls`, whose JSON-string arguments
    become dicts (templates apply `tojson` to them); tool turns keep `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of "
                                  "{'role': str, 'content': str} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] is a {type(m).__name__}, not a dict")
        if "role" not in m:
            raise InvalidRequestError(f"messages[{i}] has no 'role'")
        if not isinstance(m["role"], str):
            raise InvalidRequestError(f"messages[{i}]['role'] must be a str, not {type(m['role']).__name__}")
        if not _ROLE.fullmatch(m["role"]):  # a role is template text: "<|im_end|>" there would close a turn
            raise InvalidRequestError(f"messages[{i}]['role'] must be a name of letters, digits, '_' or '-' "
                                      f"(like 'user'), got {m['role'][:40]!r}")
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            m["tool_calls"] = _tool_calls(calls, f"messages[{i}]")
        if "content" not in m and not calls:
            raise InvalidRequestError(f"messages[{i}] has no 'content'")
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = "\n".join(_text_part(p, f"messages[{i}]['content'][{k}]") for k, p in enumerate(c))
        elif c is None and not (calls and m["role"] == "assistant"):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a str (None only in an "
                                      "assistant turn with tool_calls)")
        elif c is not None and not isinstance(c, str):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a str or a list of text parts, "
                                      f"not {type(c).__name__}")
        out.append(m)
    return out


def gemma4_tool_responses(template: str, messages: list[dict]) -> list[dict]:
    """Gemma 4's first templates read a model turn's tool results from its `tool_responses`, not from
    OpenAI `tool` turns: as llama.cpp (common/parsers/gemma4.cpp) does for a template with the call
    syntax but without the later OpenAI branch, an assistant turn with tool_calls takes the tool turns
    after it (each {name: its call's function, response: the content parsed as JSON, else the text})
    and the content of a plain assistant turn right after them. Other templates: messages as given."""
    if "'<|tool_call>call:'" not in template or "{#- OpenAI Chat Completions:" in template:
        return messages
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls") or "tool_responses" in m:
            out.append(m)
            i += 1
            continue
        turn, i, responses = {"role": "assistant", "tool_calls": m["tool_calls"]}, i + 1, []
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        while i < len(messages) and messages[i]["role"] == "tool":
            t, k = messages[i], len(responses)
            name = m["tool_calls"][k]["function"]["name"] if k < len(m["tool_calls"]) else ""
            responses.append({"name": name or t.get("tool_call_id", ""), "response": _json_or_text(t.get("content"))})
            i += 1
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i]["role"] == "assistant" and not messages[i].get("tool_calls") \
                and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        out.append(turn)
    return out


def _json_or_text(content: Any) -> Any:
    if not isinstance(content, str):
        return content
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content


def _text_part(p: Any, where: str) -> str:
    if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
        raise InvalidRequestError(f"{where} must be a {{'type': 'text', 'text': str}} part "
                                  "(this model reads text only)")
    return p["text"]


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}['tool_calls'] must be a list")
    out = []
    for k, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{where}['tool_calls'][{k}] must be {{'type': 'function', "
                                      "'function': {'name': str, 'arguments': str}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{where}['tool_calls'][{k}] arguments are not JSON: {e}") from e
        out.append(dict(tc, function=dict(fn, arguments=args)))
    return out


_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", limits: TemplateLimits = DEFAULT_LIMITS,
                **extra: Any) -> str:
    """The prompt text for `messages` under `template`; `extra` become template variables
    (tools, date_string, ...). Raises InvalidRequestError on any failure, and within
    `limits` of time, steps and size (template_limits)."""
    if not isinstance(template, str) or not template:
        raise InvalidRequestError("the model has no chat template; pass a prompt instead")
    messages = gemma4_tool_responses(template, normalize_messages(messages))
    compiled = compile_template(template)
    out, n = [], 0
    try:
        with bounded(compiled.environment.ops, limits):
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos_token, eos_token=eos_token, **extra):
                n += len(piece)
                if n > limits.output_chars:
                    raise TemplateLimitError(f"chat template rendered more than {limits.output_chars} characters")
                out.append(piece)
    except InvalidRequestError:
        raise
    except SecurityError as e:
        raise InvalidRequestError(f"chat template refused by the sandbox: {e}") from e
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template error: {e}") from e
    except MemoryError as e:
        raise InvalidRequestError("chat template ran out of memory") from e
    except Exception as e:  # a template bug (None + str, bad index, ...), not ours
        raise InvalidRequestError(f"chat template failed: {type(e).__name__}: {e}") from e
    return "".join(out)


_MARK = "\x00hearthlm-msg-{}\x00"
_MARK_RE = re.compile("\x00hearthlm-msg-(\\d+)\x00")


def encode_chat(tokenizer, template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                limits: TemplateLimits = DEFAULT_LIMITS, max_chars: int | None = None, media: bool = False,
                **extra: Any) -> list[int]:
    """Token ids of a chat prompt in which only the template's own text can produce special
    tokens: message contents are tokenized as plain text, so a user typing `<|im_end|>`
    cannot close a turn. Contents are located by rendering with markers in their place.
    `extra` (tools, ...) are template variables; rendered as template text, they may not
    hold special-token text. media: each MEDIA_MARKER in a content is an image's place
    (tokenizer.MEDIA_ID in the result)."""
    messages = gemma4_tool_responses(template, normalize_messages(messages))
    for what, v in [("tools", extra.get("tools")),  # rendered as template text: no special tokens in them
                    *((f"messages[{i}]['{k}']", m.get(k)) for i, m in enumerate(messages)
                      for k in ("tool_calls", "tool_responses"))]:
        text = json.dumps(v, ensure_ascii=False) if v is not None else ""
        if text and tokenizer.encode(text, parse_special=True) != tokenizer.encode(text):
            raise InvalidRequestError(f"{what} contain special-token text")
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    kw = dict(add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, limits=limits, **extra)
    real = render_chat(template, messages, **kw)
    if max_chars is not None and len(real) > max_chars:  # tokenizing costs ~300 bytes a character: refuse first
        raise ContextLengthError(f"the chat renders to {len(real)} characters: more than the context can take")
    marked = render_chat(template, [dict(m, content=_MARK.format(i)) if isinstance(m.get("content"), str) else m
                                    for i, m in enumerate(messages)], **kw)
    pieces = _MARK_RE.split(marked)  # template, index, template, index, ...
    for transform in (lambda c: c, str.strip):  # templates that `| trim` contents
        parts = [(p, True) if k % 2 == 0 else (transform(messages[int(p)]["content"]), False)
                 for k, p in enumerate(pieces)]
        if "".join(p for p, _ in parts) == real:
            break
    else:  # the template reshapes contents beyond recognition: refuse specials in them
        for m in (m for m in messages if isinstance(m.get("content"), str)):
            if tokenizer.encode(m["content"], parse_special=True) != tokenizer.encode(m["content"]):
                raise InvalidRequestError("a message contains special-token text, which this chat template "
                                          "cannot keep apart from its own markers")
        parts = [(real, True)]
    if media:
        parts = [q for text, special in parts for q in split_media(text, special)]
    # a template that writes the BOS itself must not get a second one
    return tokenizer.encode_parts(parts, add_special=not (bos and real.startswith(bos)))


MEDIA_MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker: an image's place in a prompt


def split_media(text: str, special: bool) -> list[tuple]:
    """(text, special) as parts with (MEDIA, special) at each MEDIA_MARKER."""
    pieces = text.split(MEDIA_MARKER)
    out: list[tuple] = [(pieces[0], special)]
    for p in pieces[1:]:
        out += [(MEDIA, special), (p, special)]
    return [q for q in out if q[0] != ""]


IMAGE_PARTS = ("image_url", "image", "input_image")


def chat_media(messages: Any) -> tuple[Any, list[Any]]:
    """Messages whose content parts include images, with each image part replaced by
    MEDIA_MARKER (llama.cpp's join: text parts joined by newlines, none around a marker), and
    the images' sources in order. Parts: {"type": "image_url", "image_url": {"url": ...}}
    (OpenAI; the url may be a plain string), {"type": "image", "image": ...} and
    {"type": "input_image", "image_url": ...}. Messages without images are left as they are."""
    if not isinstance(messages, list):
        return messages, []
    out, sources = [], []
    for i, m in enumerate(messages):
        c = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(c, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in c)):
            out.append(m)
            continue
        text, after_media = "", False
        for k, p in enumerate(c):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in IMAGE_PARTS:
                src = p.get("image") if kind == "image" else p.get("image_url")
                src = src.get("url") if isinstance(src, dict) else src
                if src is None:
                    raise InvalidRequestError(f"messages[{i}]['content'][{k}] is an image part with no image")
                sources.append(src)
                text, after_media = text + MEDIA_MARKER, True
            else:
                piece = _text_part(p, f"messages[{i}]['content'][{k}]")
                text += ("\n" if text and not after_media else "") + piece
                after_media = False
        out.append(dict(m, content=text))
    return out, sources
