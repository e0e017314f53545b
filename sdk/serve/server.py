"""`hearthlm serve`: the app from build_app under uvicorn. Imports the server extra only
when run, so the rest of the CLI works without it."""
from __future__ import annotations

import argparse
import os

from hearthlm.core.errors import HearthError


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="model(s) to serve: a .gguf path, Hub repo id or model-zoo name, served under that name "
                        "or NAME=MODEL (default: the zoo's default)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (default: env HEARTHLM_API_KEY)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--max-queued", type=int, default=1024, help="requests waiting for the engine before 429")
    p.add_argument("--max-seqs", type=int, default=64, help="requests the engine batches together")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--filename", default=None, help="file pattern inside a Hub repo, e.g. '*Q4_K_M.gguf'")
    p.add_argument("--kv-cache-type", default="f16", metavar="TYPE",
                   help="K/V cache element type: f16 (default), q8_0 (about half the memory) or q4_0")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model of the same vocabulary that drafts tokens for speculative decoding "
                        "(for every request that does not send speculative: 'off' or 'ngram')")
    p.add_argument("--draft-p-min", type=float, default=0.75, metavar="P",
                   help="drafting stops at the draft model's first token below this probability (default 0.75)")
    p.add_argument("--log-level", default="warning")


def run_serve(a: argparse.Namespace) -> None:
    try:
        import uvicorn

        from hearthlm.serve.app import MAX_BODY_BYTES, build_app
    except ImportError as e:
        raise HearthError(f"the server needs the server extra: pip install 'hearthlm[server]' ({e})") from e
    from hearthlm.model_zoo.resolve import DEFAULT_MODEL
    models = a.models or [DEFAULT_MODEL]
    app = build_app(dict(m.split("=", 1) if "=" in m else (m, m) for m in models), api_key=a.api_key or os.environ.get("HEARTHLM_API_KEY") or None,
                    max_body_bytes=a.max_body_bytes or MAX_BODY_BYTES, backend=a.backend, n_ctx=a.n_ctx,
                    max_queued_requests=a.max_queued, max_seqs=a.max_seqs, filename=a.filename,
                    kv_cache_type=a.kv_cache_type,
                    **(dict(draft_model=a.draft_model, draft_p_min=a.draft_p_min) if a.draft_model else {}))
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=10)
