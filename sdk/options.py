"""SessionOptions: every option of Session.open, declared once. Each field carries its help
text, its check and how a command line or a key=value string spells it; Session.open's and
SyncSession's keywords, the CLI flags (generate, chat, serve, bench, perplexity, ...) and the
server's per-model options (hearthlm.serve's build_app, Ray's `serve run` arguments) are
derived from it, so a new option is one field (and the code that uses it)."""
from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from hearthlm.backends import BACKENDS
from hearthlm.core import kv_types
from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.template_limits import DEFAULT_LIMITS, TemplateLimits


@dataclass(frozen=True)
class Kind:
    """What values an option takes: `ok(value)`, described by `says` in the error; `parse`
    reads one from a command line or a key=value string; a `switch` is --x / --no-x."""
    ok: Callable[[Any], bool]
    says: str
    parse: Callable[[str], Any] = str
    switch: bool = False
    choices: tuple | None = None  # the command line's choices

    def why(self, name: str, value: Any) -> str | None:
        """Why `value` is not one (the message names the option), or None."""
        return None if self.ok(value) else f"{name} must be {self.says}, got {value!r}"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _path(v) -> bool:
    return isinstance(v, (str, os.PathLike))


def _bool(text: str) -> bool:
    """A key=value string's bool (argparse's switches never call this)."""
    low = text.strip().lower()
    if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"not a bool: {text!r}")
    return low in ("1", "true", "yes", "on")


def _mmproj(text: str) -> str | bool:
    """--mmproj PATH, or 'off' for none."""
    return False if text.strip().lower() in ("off", "none", "no", "false", "0") else text


def _adapters(text: str) -> dict[str, str]:
    """'NAME=PATH[,NAME=PATH...]': LoRA adapters by name."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, path = part.partition("=")
        if not eq or not name or not path:
            raise argparse.ArgumentTypeError(f"{part!r}: expected NAME=PATH")
        out[name] = path
    return out


def _adapters_ok(v) -> bool:
    return v is None or isinstance(v, dict) and all(isinstance(k, str) and k and _path(p) for k, p in v.items())


def _limits(text: str) -> TemplateLimits:
    """'seconds=2,steps=500000': TemplateLimits with those fields changed."""
    kw = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in TemplateLimits.__dataclass_fields__ or not value:
            raise argparse.ArgumentTypeError(f"{part!r}: expected FIELD=VALUE, FIELD one of "
                                             f"{', '.join(TemplateLimits.__dataclass_fields__)}")
        try:
            kw[key] = type(getattr(DEFAULT_LIMITS, key))(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{part!r}: {e}") from e
    return replace(DEFAULT_LIMITS, **kw)


class _KVKind(Kind):
    def why(self, name: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{name} must be a string, got {value!r}"
        return kv_types.check(value, [])  # the name only: head_dim is checked once the model is known


INT1 = Kind(lambda v: _int(v) and v >= 1, "an int >= 1", int)
INT0 = Kind(lambda v: _int(v) and v >= 0, "an int >= 0", int)
OPT_INT0 = Kind(lambda v: v is None or _int(v) and v >= 0, "None or an int >= 0", int)
BOOL = Kind(lambda v: isinstance(v, bool), "True or False", _bool, switch=True)
OPT_BOOL = Kind(lambda v: v is None or isinstance(v, bool), "None, True or False", _bool, switch=True)
OPT_TEXT = Kind(lambda v: v is None or isinstance(v, str), "None or a string")
OPT_PATH = Kind(lambda v: v is None or _path(v), "None or a path")


def option(default: Any, kind: Kind, help: str, *, flags: tuple[str, ...] = (), metavar: str | None = None,
           cli: bool = True) -> Any:
    """A SessionOptions field. `flags`: more spellings on the command line than --the-name;
    cli=False: Python only (a callable has no command-line form)."""
    return field(default=default, metadata=dict(kind=kind, help=help, flags=flags, metavar=metavar, cli=cli))


@dataclass(frozen=True)
class SessionOptions:
    """How Session.open loads a model and runs its engine. Every field is also a keyword of
    Session.open and SyncSession, and (but `progress`) a flag of the CLI's model commands."""
    backend: str = option(
        "cpu", Kind(lambda v: isinstance(v, str), "a backend name", choices=BACKENDS),
        "run everything on one backend: " + ", ".join(BACKENDS))
    device: str | None = option(
        None, Kind(lambda v: v in (None, "cpu", "cuda", "auto"), "None, 'cpu', 'cuda' or 'auto'",
                   choices=("cpu", "cuda", "auto")),
        "instead of backend: 'cpu', 'cuda', or 'auto' (cuda where a GPU answers); with n_gpu_layers the "
        "layers are split between the GPU and the CPU")
    n_gpu_layers: int | None = option(
        None, OPT_INT0, "with device: the last N layers and the output head on the GPU, the rest on the CPU, "
        "as llama.cpp's -ngl (default: all layers)", metavar="N")
    n_ctx: int = option(
        2048, Kind(lambda v: _int(v) and v >= 2, "an int >= 2", int),
        "context length in tokens (at most the model's own)", metavar="N")
    filename: str | None = option(
        None, OPT_TEXT, "the file inside a Hub repo, a glob (e.g. '*Q4_K_M.gguf')", metavar="GLOB")
    kv_cache_tokens: int | None = option(
        None, OPT_INT0, "tokens the KV cache holds over all requests (default: 4 x n_ctx)", metavar="N")
    max_batch_tokens: int = option(512, INT1, "tokens one engine step computes at most", metavar="N")
    max_seqs: int = option(64, INT1, "requests the engine batches together", metavar="N")
    max_queued_requests: int = option(
        1024, INT1, "requests waiting for the engine before more are refused (QueueFull; HTTP 429)",
        flags=("--max-queued",), metavar="N")
    abort_on_close: bool = option(
        True, BOOL, "on close, abort the requests still running (their callers get SessionClosedError); "
        "off: let them finish first")
    gc_freeze: bool = option(
        True, BOOL, "after loading, take the objects then alive out of the garbage collector's full walks "
        "(gc.freeze, undone at close): a collection would otherwise walk numba's and the model's ~160,000 "
        "objects, stalling every thread (the app's event loop too) for 50-75 ms")
    fusion: bool | None = option(
        None, OPT_BOOL, "fused graphs; off runs them unfused (debugging) (default: on unless "
        "HEARTHLM_NO_FUSION=1)")
    template_limits: TemplateLimits = option(
        DEFAULT_LIMITS, Kind(lambda v: isinstance(v, TemplateLimits), "a TemplateLimits", _limits),
        "bounds on rendering the chat template, untrusted data from the file (on the command line "
        "FIELD=VALUE,...: seconds, steps, output_chars, value_len, template_chars)", metavar="LIMITS")
    chat_template: str | None = option(
        None, OPT_TEXT, "a Jinja chat template to use instead of the file's (its text; as llama.cpp's "
        "--chat-template, for a file whose template is missing or wrong); reasoning and tool-call formats "
        "are detected from it", metavar="TEXT")
    progress: Callable[[str, int, int], Any] | None = option(
        None, Kind(lambda v: v is None or callable(v), "None or a callable"),
        "progress(filename, done_bytes, total_bytes) hears how a Hub download goes (default: logged)",
        cli=False)
    weight_cache: str | os.PathLike | bool | None = option(
        None, Kind(lambda v: v is None or isinstance(v, bool) or _path(v), "None, a bool or a directory"),
        "where packed weights are kept between starts: a directory, False (or 'off') for nowhere "
        "(default: $HEARTHLM_CACHE_DIR, else the platform's cache directory)", metavar="DIR")
    prompt_cache: bool = option(
        True, BOOL, "keep prefixes written by cache_prefix() on disk; any prompt that begins with one "
        "takes its KV from there")
    prompt_cache_dir: str | os.PathLike | None = option(
        None, OPT_PATH, "where the prompt cache is kept (default: prompts/ beside the packed weights)",
        metavar="DIR")
    prompt_cache_bytes: int = option(1 << 30, INT0, "the prompt cache's size at most, in bytes", metavar="N")
    kv_cache_type: str = option(
        "f16", _KVKind(lambda v: True, "a KV cache type"),
        "the K/V cache's type by name, as llama.cpp's -ctk/-ctv: " + ", ".join(kv_types.KV_TYPES)
        + " (f16 stores float16; the quantized ones need a head_dim that is a multiple of 32, and take "
        "+rot for llama.cpp's Hadamard rotation of K/V where head_dim is a multiple of 64; cuda: f16, f32, "
        "q8_0, q4_0)",
        metavar="TYPE")
    draft_model: str | os.PathLike | None = option(
        None, OPT_PATH, "a smaller model of the same vocabulary that drafts tokens for speculative decoding "
        "(a path, Hub repo id or zoo name); every request then uses it unless it passes speculative='off' "
        "or 'ngram'", metavar="MODEL")
    draft_filename: str | None = option(
        None, OPT_TEXT, "the draft model's file inside its Hub repo, a glob", metavar="GLOB")
    draft_p_min: float = option(
        0.75, Kind(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
                   "a number in [0, 1]", float),
        "drafting stops at the draft model's first token below this probability", metavar="P")
    rollback_slots: int | None = option(
        None, OPT_INT0, "hybrid models (recurrent layers): state slots that speculating requests share for their "
        "states after drafted positions, so that rejected drafts roll back (a draft is no longer than the "
        "free slots; 0: no speculation on hybrids). Each is one sequence's whole recurrent state, allocated at "
        "open (Qwen3.5-0.8B: ~19 MB): default 16 with a draft model, else 4 (for requests "
        "that ask speculative='ngram' themselves)", metavar="N")

    mmproj: str | os.PathLike | bool | None = option(
        None, Kind(lambda v: v is None or isinstance(v, bool) or _path(v), "None, False or a path", _mmproj),
        "the vision projector (an mmproj GGUF) that lets the model see images (default: one found beside "
        "the model, <model>.mmproj.gguf or a single mmproj*.gguf, or fetched with a Hub repo's model; "
        "'off' for none)", metavar="PATH")
    adapters: dict | None = option(
        None, Kind(_adapters_ok, "None or a dict of name -> path", _adapters),
        "LoRA adapters (GGUF, as llama.cpp's convert_lora_to_gguf.py writes them) loaded at open, by name: "
        "requests choose theirs per request (adapters={name: scale}; the server's lora field or model "
        "'base:NAME')", flags=("--lora",), metavar="NAME=PATH[,NAME=PATH]")
    allow_remote_media: bool = option(
        False, BOOL, "fetch images given as http(s) URLs (off: a request can never make the process reach the "
        "network; data: URLs, bytes and, from Python, paths are read)")
    image_cache_bytes: int = option(
        256 << 20, INT0, "encoded images kept for reuse (the same image asked about again is encoded once), "
        "in bytes", metavar="N")
    max_images: int = option(16, INT0, "images one request may bring", metavar="N")
    max_image_bytes: int = option(20 << 20, INT1, "an image's encoded size at most, in bytes", metavar="N")
    max_image_pixels: int = option(
        50_000_000, INT1, "an image's decoded size at most, in pixels (checked before it is decoded)", metavar="N")

    def __post_init__(self) -> None:
        for f in fields(self):
            if why := f.metadata["kind"].why(f.name, getattr(self, f.name)):
                raise InvalidRequestError(why)
        if self.device is not None and self.backend != "cpu":
            raise InvalidRequestError(f"pass backend= or device=, not both (got {self.backend!r} and {self.device!r})")
        if self.n_gpu_layers is not None and self.device is None:
            raise InvalidRequestError("n_gpu_layers needs device='cuda' or 'auto'")
        if self.n_gpu_layers and self.device == "cpu":
            raise InvalidRequestError(f"n_gpu_layers={self.n_gpu_layers} needs device='cuda' or 'auto'")

    @classmethod
    def of(cls, options: "SessionOptions | None" = None, kwargs: Mapping[str, Any] | None = None) -> "SessionOptions":
        """`options` (default: the defaults) with the keyword arguments `kwargs` over them."""
        if options is not None and not isinstance(options, SessionOptions):
            raise TypeError(f"options must be a SessionOptions, got {type(options).__name__}")
        check_names(kwargs or {})
        return replace(options, **kwargs) if options is not None else cls(**(kwargs or {}))

    def kwargs(self) -> dict[str, Any]:
        """The fields as Session.open's keyword arguments (values as they are: no deep copy)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_strings(cls, values: Mapping[str, str]) -> "SessionOptions":
        """From key=value strings (Ray's `serve run` arguments), each read by its field's kind."""
        check_names(values)
        by_name = {f.name: f for f in fields(cls)}
        kw = {}
        for k, v in values.items():
            try:
                kw[k] = by_name[k].metadata["kind"].parse(v) if isinstance(v, str) else v
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise InvalidRequestError(f"{k}: {e}") from e
        return cls(**kw)


NAMES = tuple(f.name for f in fields(SessionOptions))


def check_names(kwargs: Mapping[str, Any], what: str = "Session.open()") -> None:
    for k in kwargs:
        if k not in NAMES:
            raise TypeError(f"{what} got an unexpected keyword argument {k!r}")


# ---- Python: signatures and docs derived from the fields ------------------------------------

def docs(indent: str = "    ") -> str:
    """One line per option: name, default, help."""
    out = []
    for f in fields(SessionOptions):
        out.append(f"{indent}{f.name}={f.default!r}: {f.metadata['help']}")
    return "\n".join(out)


def takes_options(fn: Callable) -> Callable:
    """For `fn(..., options=None, **kwargs)` taking SessionOptions' fields as keywords: its
    signature lists each field (with its default) in place of **kwargs, its doc each field's help."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in fields(SessionOptions) if f.name not in sig.parameters]
    fn.__signature__ = sig.replace(parameters=params)
    fn.__doc__ = f"{fn.__doc__ or ''}\n\n    Options (hearthlm.SessionOptions' fields):\n{docs(' ' * 8)}"
    return fn


# ---- the command line ---------------------------------------------------------------------

def flags_of(name: str) -> tuple[str, ...]:
    f = SessionOptions.__dataclass_fields__[name]
    return ("--" + name.replace("_", "-"), *f.metadata["flags"])


def add_arguments(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                  help: Mapping[str, str] | None = None, defaults: Mapping[str, str] | None = None) -> None:
    """A flag per option (those in `only`, else every one but Python-only ones), in a group of
    their own. A flag left out leaves its name out of the parsed namespace, so that
    `from_args` can tell a given flag from a command's own default. `help`: a command's
    words on an option, added to the field's; `defaults`: a command's own defaults, as shown."""
    g = p.add_argument_group("session options", "as hearthlm.SessionOptions (Python only: progress)")
    names = list(only) if only is not None else [f.name for f in fields(SessionOptions) if f.metadata["cli"]]
    for name in names:
        f = SessionOptions.__dataclass_fields__[name]
        kind, text = f.metadata["kind"], f.metadata["help"]
        if help and name in help:
            text += "; " + help[name]
        if defaults and name in defaults:
            text += f" (default: {defaults[name]})"
        elif f.default is not None:
            text += f" (default: {_shown(f.default)})"
        kw: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=text)
        if kind.switch:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=kind.parse, metavar=f.metadata["metavar"])
            if kind.choices:
                kw.update(choices=kind.choices, metavar=None)
        g.add_argument(*flags_of(name), **kw)


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, TemplateLimits):
        return ",".join(f"{k}={getattr(default, k)}" for k in TemplateLimits.__dataclass_fields__)
    return str(default).replace("%", "%%")


def from_args(a: argparse.Namespace, *, override: Mapping[str, Any] | None = None,
              **defaults: Any) -> SessionOptions:
    """The options a parsed command line gives: the flags given win over `defaults` (a
    command's own, such as bench's batch sizes); `override` wins over both."""
    given = {k: v for k, v in vars(a).items() if k in NAMES}
    return SessionOptions(**{**defaults, **given, **(override or {})})
