"""hearthlm.serve: an OpenAI-compatible HTTP server (`hearthlm serve`) and a Ray Serve
deployment (`hearthlm.serve.ray`), over the public Session API. Needs `hearthlm[server]`;
importing this package does not (the CLI lists `serve` without it)."""
from __future__ import annotations

__all__ = ["build_app", "create_app"]


def __getattr__(name: str):
    if name in __all__:
        from hearthlm.serve import app
        return getattr(app, name)
    raise AttributeError(name)
