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

from hearthlm.options import NAMES, SessionOptions, takes_options
from hearthlm.serve.app import build_app as build_asgi_app


@takes_options
def build_app(model: str, *, name: str | None = None, api_key: str | None = None,
              num_replicas: int | str | None = None, autoscaling_config: dict | None = None,
              max_ongoing_requests: int | None = None, ray_actor_options: dict | None = None,
              options: SessionOptions | None = None, **session_options: Any) -> serve.Application:
    """A Ray Serve application serving `model` (as `name`, default the model string) with
    Session.open(model, options=options, **session_options) in each replica. max_ongoing_requests
    defaults to the engine's batch (max_seqs): Ray's default of 5 would leave the batcher starved."""
    served = name or model
    opts = SessionOptions.of(options, session_options)
    asgi = build_asgi_app({served: model}, api_key=api_key, options=opts)
    ongoing = max_ongoing_requests or opts.max_seqs

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


_INTS = {"num_replicas", "max_ongoing_requests"}  # the deployment's own; the session options by their fields


def app(args: dict[str, str]) -> serve.Application:
    """The builder `serve run hearthlm.serve.ray:app model=... [n_ctx=...]` calls with its
    key=value arguments (strings, each session option read as its SessionOptions field says)."""
    if "model" not in args:
        raise ValueError("serve run hearthlm.serve.ray:app model=NAME_OR_PATH [n_ctx=N max_seqs=N ...]")
    kw: dict[str, Any] = {k: int(v) if k in _INTS and str(v).isdigit() else v
                          for k, v in args.items() if k not in NAMES}
    opts = SessionOptions.from_strings({k: v for k, v in args.items() if k in NAMES})
    return build_app(kw.pop("model"), options=opts, **kw)
