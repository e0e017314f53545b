"""`hearthlm serve`: the app from build_app under uvicorn. Imports the server extra only
when run, so the rest of the CLI works without it. Every session option is a flag (the
same for each model served)."""
from __future__ import annotations

import argparse
import os

from hearthlm import options
from hearthlm.core.errors import HearthError


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="model(s) to serve: a .gguf path, Hub repo id or model-zoo name, served under that name "
                        "or NAME=MODEL (default: the zoo's default)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (default: env HEARTHLM_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every .gguf in DIR by its file's stem, each loaded when a request names it (no MODEL)")
    p.add_argument("--max-loaded", type=int, default=None, metavar="N",
                   help="with --models-dir: at most N loaded; the least recently used leaves after its requests")
    p.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                   help="with --models-dir: unload a model idle this long (default: keep it; Ollama's keep_alive wins)")
    options.add_arguments(p)


def run_serve(a: argparse.Namespace) -> None:
    opts = options.from_args(a)  # checked before the server starts
    try:
        import uvicorn

        from hearthlm.serve.app import MAX_BODY_BYTES, build_app
    except ImportError as e:
        raise HearthError(f"the server needs the server extra: pip install 'hearthlm[server]' ({e})") from e
    from hearthlm.model_zoo.resolve import DEFAULT_MODEL
    app_args = dict(api_key=a.api_key or os.environ.get("HEARTHLM_API_KEY") or None,
                    max_body_bytes=a.max_body_bytes or MAX_BODY_BYTES)
    if a.models_dir is not None:
        if a.models:
            raise HearthError("give MODEL arguments or --models-dir, not both")
        from hearthlm.serve.router import build_router_app
        app = build_router_app(a.models_dir, max_loaded=a.max_loaded, idle_unload=a.idle_unload, options=opts,
                               **app_args)
    elif a.max_loaded is not None or a.idle_unload is not None:
        raise HearthError("--max-loaded and --idle-unload go with --models-dir")
    else:
        models = a.models or [DEFAULT_MODEL]
        app = build_app(dict(m.split("=", 1) if "=" in m else (m, m) for m in models), **app_args, **opts.kwargs())
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=10)
