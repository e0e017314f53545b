"""JSON schemas for Python callables, for Session.act's tools: the parameters from the
signature's type hints, the descriptions from the docstring (its first paragraph; Google
"Args:" or numpy "Parameters" sections for the parameters); and a small check of a model's
arguments against such a schema (the subset it writes, so that no jsonschema is needed)."""
from __future__ import annotations

import collections.abc
import enum
import inspect
import re
import types
import typing
from typing import Any, Callable

from hearthlm.core.errors import InvalidRequestError

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
               "array": (list,), "object": (dict,)}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments):?$")
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\(.*\))?\s*(?::\s*(.*))?$")


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """OpenAI's function tool shape for `fn`: {"type": "function", "function": {"name",
    "description", "parameters"}}; a parameter with a default is not required."""
    name = name or getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidRequestError(f"a tool needs a name (an identifier); {fn!r} has {name!r}")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:  # a hint that does not resolve names the tool
        raise InvalidRequestError(f"tool {name}: its type hints do not resolve: {e}") from e
    description, docs = parse_docstring(inspect.getdoc(fn) or "")
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
            continue
        try:
            s = type_schema(hints.get(p.name, Any))
        except TypeError as e:
            raise InvalidRequestError(f"tool {name}: parameter {p.name!r}: {e}") from e
        if p.name in docs:
            s = {**s, "description": docs[p.name]}
        props[p.name] = s
        if p.default is p.empty:
            required.append(p.name)
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def type_schema(t: Any) -> dict:
    """The JSON schema of a type hint: str, int, float, bool, None, list[...], tuple[...],
    dict[str, ...], Optional / unions, Literal, Enum, Annotated[T, "description"], Any."""
    if t is Any or t is inspect.Parameter.empty:
        return {}
    if t in _SCALARS:
        return {"type": _SCALARS[t]}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return _enum([m.value for m in t])
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        notes = [a for a in args[1:] if isinstance(a, str)]
        return {**type_schema(args[0]), **({"description": notes[0]} if notes else {})}
    if origin is typing.Literal:
        return _enum(list(args))
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [type_schema(a) for a in args]}
    if t in (list, tuple, set, frozenset) or origin in (list, set, frozenset, collections.abc.Sequence):
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    if origin is tuple:
        return {"type": "array", "items": type_schema(args[0])} if len(args) == 2 and args[1] is ... \
            else {"type": "array", "prefixItems": [type_schema(a) for a in args], "minItems": len(args), "maxItems": len(args)}
    if t is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": type_schema(args[1])} if args and args[1] is not Any else {})}
    raise TypeError(f"no JSON schema for the type {t!r} (use str, int, float, bool, list, dict, Literal, Enum, ...)")


def _enum(values: list) -> dict:
    kinds = {_SCALARS.get(type(v)) for v in values}
    return {"type": kinds.pop(), "enum": values} if len(kinds) == 1 and None not in kinds else {"enum": values}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph as one line, {parameter: description}) of a cleaned
    docstring, reading Google-style ("Args:" then indented "name (type): text") and numpy-style
    ("Parameters", a dashed line, then "name : type" with indented text) sections."""
    lines = doc.splitlines()
    first = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    params: dict[str, str] = {}
    for i, line in enumerate(lines):
        if not _SECTION.match(line.strip()):
            continue
        indent = len(line) - len(line.lstrip())
        numpy = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
        _section_entries(lines[i + 2:] if numpy else lines[i + 1:], indent, numpy, params)
    return " ".join(first), params


def _section_entries(lines: list[str], indent: int, numpy: bool, out: dict[str, str]) -> None:
    name, base = None, None
    for j, line in enumerate(lines):
        if not line.strip():
            continue
        ind = len(line) - len(line.lstrip())
        if numpy and j + 1 < len(lines) and set(lines[j + 1].strip()) == {"-"}:
            return  # the next numpy section
        if ind < indent or (not numpy and ind == indent):
            return  # the Google section ended
        base = ind if base is None else base
        m = _ENTRY.match(line.strip()) if ind == base else None
        if m:
            name = m.group(1)
            out[name] = (m.group(2) or "").strip() if not numpy else ""
        elif name is not None:
            out[name] = (out[name] + " " + line.strip()).strip()


def check_arguments(value: Any, schema: dict, at: str = "arguments") -> str | None:
    """What is wrong with `value` against `schema` (the keywords this module writes, and
    those common in MCP tools' schemas; others are not checked), or None when it fits."""
    if not isinstance(schema, dict):
        return None
    if "anyOf" in schema or "oneOf" in schema:
        subs = schema.get("anyOf") or schema.get("oneOf")
        if all(check_arguments(value, s, at) for s in subs):
            return f"{at} fits none of the allowed types"
    if "enum" in schema and value not in schema["enum"]:
        return f"{at} must be one of {schema['enum']}, got {value!r}"
    if "const" in schema and value != schema["const"]:
        return f"{at} must be {schema['const']!r}"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        ok = any(isinstance(value, _JSON_TYPES.get(k, object)) and not (k in ("integer", "number") and isinstance(value, bool))
                 for k in kinds)
        if not ok:
            return f"{at} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r}"
    if isinstance(value, dict):
        return _check_object(value, schema, at)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return next((p for i, v in enumerate(value) if (p := check_arguments(v, schema["items"], f"{at}[{i}]"))), None)
    return None


def _check_object(value: dict, schema: dict, at: str) -> str | None:
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required", ()) if k not in value]
    if missing:
        return f"{at} lacks the required {', '.join(map(repr, missing))}"
    extra = schema.get("additionalProperties", True)
    for k, v in value.items():
        if k in props:
            problem = check_arguments(v, props[k], f"{at}.{k}")
        elif extra is False:
            problem = f"{at} has no parameter {k!r} (it takes {', '.join(props) or 'none'})"
        else:
            problem = check_arguments(v, extra, f"{at}.{k}") if isinstance(extra, dict) else None
        if problem:
            return problem
    return None
