"""hearthlm.bench: the measurement tools behind `hearthlm bench` (and `hearthlm prepare`), kept
out of the package root beside Session. `command` parses the flags and picks the measurement:
`speed` (prefill, decode, concurrency, constrained decoding, competing load), `embed`,
`profile` (time per op kind per decode step), `startup` (fresh processes; `prepare`),
`speculative`, `roofline` (bytes read per token), and `vision` (--image: a vision tower's encode
and time to first token; `vision_files` makes random towers at real shapes, `vision_llama_cpp`
is llama.cpp's side for --image; `yardstick` runs `llama_cpp_side` for every other mode, in the
interpreter --llama-cpp-python names, and gathers the host and build facts each report names)."""
from __future__ import annotations

import argparse

from hearthlm.options import SessionOptions, from_args


def kv_types(a: argparse.Namespace) -> list[str]:
    """The --kv-cache-type list (bench measures each in turn); ["f16"] when not given."""
    return [t.strip() for t in getattr(a, "kv_cache_type", "f16").split(",") if t.strip()] or ["f16"]


def session_options(a: argparse.Namespace, kv_cache_type: str | None = None, **defaults) -> SessionOptions:
    """The session options of bench's flags, with a measurement's own `defaults` where no flag
    was given; the KV type is `kv_cache_type`, else the first of the list."""
    return from_args(a, override={"kv_cache_type": kv_cache_type or kv_types(a)[0]}, **defaults)
