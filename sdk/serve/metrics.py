"""/metrics in Prometheus text: each session's engine stats, read at scrape time, plus the
server's own counters. One registry per app (several apps in a process do not collide)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# engine stats key -> (metric name, help, counter?)
ENGINE = {
    "tokens_generated": ("hearthlm_generated_tokens", "tokens generated", True),
    "tokens_computed": ("hearthlm_computed_tokens", "tokens run through the model (prompts and generated)", True),
    "prefix_cache_hit_tokens": ("hearthlm_prefix_cache_hit_tokens", "prompt tokens reused from the prefix cache", True),
    "graph_cache_hits": ("hearthlm_graph_cache_hits", "steps that reused a compiled graph", True),
    "graph_cache_misses": ("hearthlm_graph_cache_misses", "steps that built a graph", True),
    "preemptions": ("hearthlm_preemptions", "requests preempted for KV blocks", True),
    "spec_drafted_tokens": ("hearthlm_speculative_drafted_tokens", "draft tokens proposed by speculative decoding", True),
    "spec_accepted_tokens": ("hearthlm_speculative_accepted_tokens", "draft tokens the model kept", True),
    "queue_depth": ("hearthlm_queue_depth", "requests waiting for the engine", False),
    "running_requests": ("hearthlm_running_requests", "requests in the running batch", False),
    "kv_blocks_used": ("hearthlm_kv_blocks_used", "KV cache blocks in use", False),
    "kv_blocks_total": ("hearthlm_kv_blocks_total", "KV cache blocks", False),
    "time_to_first_token_s": ("hearthlm_time_to_first_token_seconds", "median time to first token (last 1000 requests)", False),
    "tokens_per_s": ("hearthlm_decode_tokens_per_second", "generated tokens per second of engine step time", False),
}


class _EngineCollector:
    def __init__(self, host) -> None:
        self.host = host

    def collect(self):
        fams = {}
        for key, (name, doc, counter) in ENGINE.items():
            fams[key] = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["model"])
        for model, s in list(self.host.sessions.items()):
            st = s.stats()
            for key, fam in fams.items():
                if st.get(key) is not None:
                    fam.add_metric([model], float(st[key]))
        yield from fams.values()


class Metrics:
    def __init__(self, host) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(host))
        self.errors = Counter("hearthlm_http_errors", "error responses by status", ["status"], registry=self.registry)
        self.streamed = Counter("hearthlm_streams", "streamed responses ended", registry=self.registry)
        self.disconnects = Counter("hearthlm_client_disconnects", "non-streamed requests aborted by a disconnect",
                                   registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
