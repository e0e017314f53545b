"""Issue 14's hostile-input checks through HTTP: a model file whose chat template hangs or
blows up gets a 400 within about a second per request, and the server keeps serving plain
completions on the same model."""
import time

import httpx
import pytest
from fuzz.gguf_target import STRING
from serve_util import live_server
from test_fuzz_regressions import tiny_with

TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "string doubling": "{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 64 + "{{ s }}",
    "escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_hostile_template_is_a_400_and_the_server_serves_on(tmp_path, name):
    path = str(tiny_with(tmp_path, tokenizer__chat_template=(STRING, TEMPLATES[name])))
    with live_server(path, "--n-ctx", "256") as url:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json=dict(model=path, messages=[{"role": "user", "content": "hi"}], max_tokens=4))
        took = time.perf_counter() - t0
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], r.text
        assert took < 3.0, took  # the render's limit is 1 s
        ok = httpx.post(url + "/v1/completions", timeout=30, json=dict(model=path, prompt="hi", max_tokens=3))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
        assert httpx.get(url + "/health", timeout=10).status_code == 200
