"""hearthlm.serve.ray on a local Ray (2 CPUs, one replica), through Ray's HTTP proxy with the
openai client. Needs `hearthlm[ray]`: `make test-ray` installs it and runs this file; plain
`make test` leaves it out (marker `ray`), as Ray is a large install and slow to start."""
from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from serve_util import free_port  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402


@pytest.fixture(scope="module")
def ray_url(tmp_path_factory):
    tiny = str(write_tiny(tmp_path_factory.mktemp("ray") / "tiny.gguf"))
    from hearthlm.serve.ray import app, build_app
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # the `serve run hearthlm.serve.ray:app model=...` builder, with its string arguments
        application = app({"model": tiny, "name": "tiny", "n_ctx": "256", "max_seqs": "16"})
        serve.run(application, name="hearthlm", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:  # the replica loads the model in its lifespan; bounded wait
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Ray replica did not become healthy"
            time.sleep(0.5)
        yield url, build_app
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_client_through_ray_proxy(ray_url):
    url, build_app = ray_url
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    e = c.embeddings.create(model="tiny", input=["a", "b"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == 64
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    # the deployment's settings: the batch, not Ray's default of 5
    d = serve.status().applications["hearthlm"].deployments["hearthlm"]
    assert d.status == "HEALTHY"
    app = build_app("m.gguf", max_seqs=48, autoscaling_config={"min_replicas": 1, "max_replicas": 4,
                                                                "target_ongoing_requests": 24})
    assert app._bound_deployment.max_ongoing_requests == 48
    assert app._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4
