"""Ray Serve: the same ASGI app (hearthlm.serve.app.build_app) as a deployment, one Session
per replica. Needs `hearthlm[ray]`.

    serve run hearthlm.serve.ray:app model=smollm2-135m-instruct n_ctx=4096
    serve.run(build_app("smollm2-135m-instruct", num_replicas="auto"))  # from Python

Scaling: each replica is one engine; Ray's proxy spreads requests over replicas (on every
node of a Ray cluster). With `num_replicas="auto"` or an `autoscaling_config`, e.g.
{"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32}, Ray adds replicas
when requests per replica stay above the target; a target near half of max_ongoing_requests
keeps each engine's batch full without long queues."""
from __future__ import annotations

from typing import Any

from ray import serve

from hearthlm.serve.app import build_app as build_asgi_app


def build_app(model: str, *, name: str | None = None, api_key: str | None = None,
              num_replicas: int | str | None = None, autoscaling_config: dict | None = None,
              max_ongoing_requests: int | None = None, ray_actor_options: dict | None = None,
              **session_options: Any) -> serve.Application:
    """A Ray Serve application serving `model` (as `name`, default the model string) with
    Session.open(model, **session_options) in each replica. max_ongoing_requests defaults to
    the engine's batch (max_seqs, 64): Ray's default of 5 would leave the batcher starved."""
    served = name or model
    asgi = build_asgi_app({served: model}, api_key=api_key, **session_options)
    ongoing = max_ongoing_requests or session_options.get("max_seqs", 64)

    @serve.deployment(name="hearthlm", max_ongoing_requests=ongoing, health_check_period_s=10,
                      health_check_timeout_s=30, ray_actor_options=ray_actor_options or {"num_cpus": 1})
    @serve.ingress(asgi)
    class HearthLM:
        def check_health(self) -> None:
            """Raises (Ray restarts the replica) once an engine stopped serving."""
            host = self._asgi_app.state.host  # the replica's own copy of the app, started by its lifespan
            for n, s in host.sessions.items():
                h = s.health()
                if not h["ok"] and not h["closing"]:
                    raise RuntimeError(f"model {n!r}: {h['error']}")

    opts: dict[str, Any] = {}
    if num_replicas is not None:
        opts["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        opts["autoscaling_config"] = autoscaling_config
    return (HearthLM.options(**opts) if opts else HearthLM).bind()


_INTS = {"n_ctx", "max_seqs", "max_batch_tokens", "max_queued_requests", "kv_cache_tokens", "n_gpu_layers",
         "num_replicas", "max_ongoing_requests"}


def app(args: dict[str, str]) -> serve.Application:
    """The builder `serve run hearthlm.serve.ray:app model=... [n_ctx=...]` calls with its
    key=value arguments (strings; the numeric ones are converted)."""
    if "model" not in args:
        raise ValueError("serve run hearthlm.serve.ray:app model=NAME_OR_PATH [n_ctx=N max_seqs=N ...]")
    kw: dict[str, Any] = {k: int(v) if k in _INTS and str(v).isdigit() else v for k, v in args.items()}
    return build_app(kw.pop("model"), **kw)
