"""Tool-call formats, keyed by model family as chat templates are: how a model writes a call,
how to parse it into OpenAI-shaped `tool_calls`, and the grammar that forces one call
(tool_choice "required" or a named function).

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
- llama3 (Llama 3.x): `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}`
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from hearthlm.core.errors import InvalidRequestError

# the JSON inside a forced call: compact, as models write it
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DECODER = json.JSONDecoder()


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict], str | None]:
    """Validated (tools, choice) where choice is "auto", "none", "required" or a function name."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequestError(f"tools[{i}] parameters must be a JSON schema object")
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise InvalidRequestError(f"tool_choice names a function that is not in tools: {name!r}")
        return tools, name
    if choice not in ("auto", "none", "required"):
        raise InvalidRequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    return tools, choice


def _call_schema(fn: dict, args_key: str) -> dict:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(tools: list[dict], choice: str, args_key: str) -> dict:
    fns = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    schemas = [_call_schema(fn, args_key) for fn in fns]
    s = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return dict(s, **{"x-guidance": _COMPACT})


def _call(name: str, args: Any) -> dict:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args if args is not None else {}, ensure_ascii=False)}}


def _json_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[i] (after spaces) and where it ends, or None."""
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        return _DECODER.raw_decode(text, i)
    except ValueError:
        return None


def _named(obj: Any, args_key: str) -> dict | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if isinstance(args, dict):
            return _call(obj["name"], args)
    return None


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]   # text that starts a call (streamed text is held from there)
    args_key: str

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a model's output; no calls when none parse. `names`: the
        offered functions, for formats that accept a bare call naming one of them."""
        return text, []

    def safe_prefix(self, text: str) -> int:
        """How much of `text` (a streamed output so far) cannot be part of a call: a marker
        and what follows it wait, and so does a tail that could begin one."""
        at = min((i for i in (text.find(m) for m in self.markers) if i >= 0), default=-1)
        if at >= 0:
            return at
        for k in range(min(max(map(len, self.markers)) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return len(text) - k
        return len(text)

    def grammar(self, tools: list[dict], choice: str, special=lambda text: None) -> str:
        """Lark (llguidance) text for exactly one call to one of `tools` (or the named one);
        `special(text)`: the id of the control token spelled `text`, or None where it is none."""
        raise NotImplementedError


class Hermes(ToolFormat):
    _RE = re.compile(r"<tool_call>")
    # Qwen2.5-Coder often writes its call as the whole reply, bare or in a ```json fence
    _BARE = re.compile(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", re.S)

    def safe_prefix(self, text):
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith("```") or "```".startswith(body):
            return 0  # may be a bare call: held until it is clear
        return super().safe_prefix(text)

    def parse(self, text, names=frozenset()):
        calls, first = [], text.find("<tool_call>")
        if first < 0:
            bare = self._BARE.fullmatch(text)
            got = _json_at(bare.group(1), 0) if bare else None
            call = _named(got[0], self.args_key) if got and got[1] == len(bare.group(1)) else None
            return (None, [call]) if call and call["function"]["name"] in names else (text, [])
        for m in self._RE.finditer(text):
            got = _json_at(text, m.end())
            call = _named(got[0], self.args_key) if got else None
            if call is None:
                return text, []  # not a well-formed call: the text stays text
            calls.append(call)
        content = text[:first].strip()
        return content or None, calls

    def grammar(self, tools, choice, special=lambda text: None):
        return ('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: %json {json.dumps(_one_of(tools, choice, self.args_key))}")


class Llama3(ToolFormat):
    def safe_prefix(self, text):  # a call is the whole output: wait while it could be one
        body = text.lstrip()
        could_be_call = not body or body.startswith("{") or "<|python_tag|>".startswith(body[:14])
        return 0 if could_be_call else len(text)

    def parse(self, text, names=frozenset()):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        calls, i = [], 0
        while True:  # one or more JSON objects, maybe separated by ';'
            got = _json_at(body, i)
            call = _named(got[0], self.args_key) if got else None
            if call is None:
                break
            calls.append(call)
            i = got[1]
            rest = body[i:].lstrip()
            if not rest.startswith(";"):
                break
            i = len(body) - len(rest) + 1
        if not calls or body[i:].strip():
            return text, []
        return None, calls

    def grammar(self, tools, choice, special=lambda text: None):
        return f"start: %json {json.dumps(_one_of(tools, choice, self.args_key))}"


class Mistral(ToolFormat):
    def parse(self, text, names=frozenset()):
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        body, calls = text[at + len("[TOOL_CALLS]"):], []
        got = _json_at(body, 0)
        if got and isinstance(got[0], list):  # v3: a JSON list of calls
            calls = [_named(o, self.args_key) for o in got[0]]
        else:  # v11+: name[ARGS]{...}, repeated
            for seg in body.split("[TOOL_CALLS]"):
                name, sep, rest = seg.partition("[ARGS]")
                got = _json_at(rest, 0) if sep else None
                calls.append(_call(name.strip(), got[0]) if got and isinstance(got[0], dict) and name.strip()
                             else None)
        if not calls or None in calls:
            return text, []
        return text[:at].strip() or None, calls

    def grammar(self, tools, choice, special=lambda text: None):
        start = _literal("[TOOL_CALLS]", special)
        items = _one_of(tools, choice, self.args_key)
        arr = {"type": "array", "items": items, "minItems": 1, "maxItems": 1, "x-guidance": _COMPACT}
        return f"start: {start} call\ncall: %json {json.dumps(arr)}"


class Harmony(ToolFormat):
    """gpt-oss: a call is a commentary-channel message to `functions.NAME`, its arguments JSON:
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the
    recipient may stand in the role part instead: `<|start|>assistant to=functions.NAME<|channel|>...`)."""
    _RE = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>")

    def parse(self, text, names=frozenset()):
        calls = []
        for m in self._RE.finditer(text):
            got = _json_at(text, m.end())
            if got is None or not isinstance(got[0], dict):
                return text, []
            calls.append(_call(m.group(1), got[0]))
        if not calls:
            return text, []
        head = text[:text.find("to=functions.")]
        final = head.rfind("<|channel|>final<|message|>")  # an answer before the call, where there is one
        content = head[final + len("<|channel|>final<|message|>"):].split("<|end|>")[0].strip() if final >= 0 else ""
        return content or None, calls

    def grammar(self, tools, choice, special=lambda text: None):
        items = [t for t in tools if choice in ("required", t["function"]["name"])]
        calls = " | ".join(f"call{i}" for i in range(len(items)))
        rules = [f"start: {_literal('<|channel|>', special)} \"commentary to=functions.\" ({calls})"]
        for i, t in enumerate(items):
            fn = t["function"]
            schema = fn.get("parameters") or {"type": "object"}
            rules.append(f"call{i}: {json.dumps(fn['name'])} \" \" {_literal('<|constrain|>', special)} \"json\" "
                         f"{_literal('<|message|>', special)} %json {json.dumps(schema)}")
        return "\n".join(rules)


class Gemma4(ToolFormat):
    """Gemma 4: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, keys bare, strings between
    `<|"|>` marks, numbers, true/false/null, nested {...} and [...] (its template's format_argument)."""
    _RE = re.compile(r"<\|tool_call>call:([^{\s<]+)\{")
    _NUM = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
    _QUOTE = '<|"|>'

    def parse(self, text, names=frozenset()):
        first, calls = text.find("<|tool_call>"), []
        if first < 0:
            return text, []
        for m in self._RE.finditer(text):
            got = self._value(text, m.end() - 1)
            if got is None or not isinstance(got[0], dict):
                return text, []
            calls.append(_call(m.group(1), got[0]))
        if not calls:
            return text, []
        return text[:first].strip() or None, calls

    def _value(self, t: str, i: int):
        """(value, end) of the value at t[i], or None where it is not one."""
        q = self._QUOTE
        if t.startswith(q, i):
            j = t.find(q, i + len(q))
            return None if j < 0 else (t[i + len(q):j], j + len(q))
        if t.startswith("{", i) or t.startswith("[", i):
            obj, close, i = ({}, "}", i + 1) if t[i] == "{" else ([], "]", i + 1)
            while i < len(t) and t[i] != close:
                if isinstance(obj, dict):
                    if t.startswith(q, i):  # a quoted key
                        got = self._value(t, i)
                        if got is None:
                            return None
                        key, i = got
                    else:
                        j = t.find(":", i)
                        if j < 0:
                            return None
                        key, i = t[i:j].strip(), j
                    if not t.startswith(":", i):
                        return None
                    got = self._value(t, i + 1)
                    if got is None:
                        return None
                    obj[key], i = got
                else:
                    got = self._value(t, i)
                    if got is None:
                        return None
                    obj.append(got[0])
                    i = got[1]
                if t.startswith(",", i):
                    i += 1
            return None if i >= len(t) else (obj, i + 1)
        for word, v in (("true", True), ("false", False), ("null", None)):
            if t.startswith(word, i):
                return v, i + len(word)
        m = self._NUM.match(t, i)
        if m:
            return (float(m.group()) if any(c in m.group() for c in ".eE") else int(m.group())), m.end()
        return None

    def grammar(self, tools, choice, special=lambda text: None):
        names = [t["function"]["name"] for t in tools if choice in ("required", t["function"]["name"])]
        # the arguments' own syntax is Gemma's, not JSON: the call's frame and name are forced, its body
        # is any text with braces nested one deep
        return (f"start: {_literal('<|tool_call>', special)} \"call:\" ({' | '.join(json.dumps(n) for n in names)}) "
                f"\"{{\" BODY \"}}\" {_literal('<tool_call|>', special)}\n"
                "BODY: /([^{}]|\\{[^{}]*\\})*/")


def _literal(text: str, special) -> str:
    """A grammar's terminal for `text`: its control token where the vocabulary has one."""
    tid = special(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


FORMATS: dict[str, ToolFormat] = {
    "hermes": Hermes("hermes", ("<tool_call>",), "arguments"),
    "llama3": Llama3("llama3", ("<|python_tag|>",), "parameters"),
    "mistral": Mistral("mistral", ("[TOOL_CALLS]",), "arguments"),
    "harmony": Harmony("harmony", ("<|channel|>commentary", "to=functions."), "arguments"),
    "gemma4": Gemma4("gemma4", ("<|tool_call>",), "arguments"),
}
# families by GGUF architecture, where the template does not say
_BY_ARCH = {"qwen2": "hermes", "qwen3": "hermes", "qwen2moe": "hermes", "qwen3moe": "hermes", "gpt-oss": "harmony", "gemma4": "gemma4"}


def tool_format(arch: str, template: str | None) -> ToolFormat:
    """The model family's format: from the markers its chat template writes, else its
    architecture; Hermes-style otherwise (then the tools are described in a system message)."""
    t = template or ""
    if "<|tool_call>" in t:
        return FORMATS["gemma4"]
    if "<|channel|>" in t and "commentary" in t:  # harmony (gpt-oss): calls go to the commentary channel
        return FORMATS["harmony"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|start_header_id|>" in t and "tools" in t:
        return FORMATS["llama3"]
    return FORMATS[_BY_ARCH.get(arch, "hermes")]


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes-style tool description, for templates that ignore `tools`."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call a function, reply with a JSON object with the function name and arguments within "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def as_hermes_chat(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that knows nothing of tools: `messages` (normalized) with the tools
    described in the system message (added first if none), earlier calls written into their
    assistant turns and tool results wrapped in <tool_response>, as Hermes does."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]},
                                                          ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            m = {"role": m["role"], "content": ((m.get("content") or "") + "\n" + calls).lstrip("\n")}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if not tools:
        return out
    prompt = tools_system_prompt(tools)
    if out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
        return [dict(out[0], content=out[0]["content"] + "\n\n" + prompt), *out[1:]]
    return [{"role": "system", "content": prompt}, *out]
