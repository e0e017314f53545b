"""LoRA adapters through `hearthlm serve --lora NAME=PATH,...` and the official openai client:
llama-server's per-request `lora` field (by id or name), vLLM's adapter names as `model`
("BASE:ADAPTER" or the adapter's name), the listings (/v1/models, Ollama's /api/tags), Ollama's
/api/generate on an adapter, and the errors."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from hearthlm.bench.lora_files import write_lora

openai = pytest.importorskip("openai")

from serve_util import live_server  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

KW = dict(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_lora")
    tiny = write_tiny(d / "tiny.gguf")
    return str(tiny), {n: str(write_lora(d / f"{n}.gguf", tiny, seed=i, size=1.0)) for i, n in ((1, "a"), (2, "b"))}


@pytest.fixture(scope="module")
def server(files):
    tiny, ads = files
    with live_server(tiny, "--lora", ",".join(f"{n}={p}" for n, p in ads.items()), "--n-ctx", "512") as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _text(c, model, **extra):
    return c.completions.create(model=model, prompt="hello there", extra_body=extra or None, **KW).choices[0].text


def test_adapters_by_model_name_and_lora_field(server, files):
    """The adapter chosen as "BASE:a", as "a", by the lora field's id 0 or name: one output, not the
    base's; id 1 is b; a lora entry at scale 0 is the base. Mutation: adapter_kwargs ignoring the
    model name's adapter (`out = {}`) fails it."""
    tiny, _ = files
    c = client(server)
    base = _text(c, tiny)
    a = _text(c, f"{tiny}:a")
    assert a != base
    assert _text(c, "a") == a == _text(c, tiny, lora=[{"id": 0, "scale": 1.0}]) == _text(c, tiny, lora=[{"name": "a", "scale": 1}])
    b = _text(c, tiny, lora=[{"id": 1, "scale": 1.0}])
    assert b not in (a, base) and _text(c, "b") == b
    assert _text(c, "a", lora=[{"name": "a", "scale": 0.0}]) == base
    chat = c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], **KW)
    again = c.chat.completions.create(model=tiny, messages=[{"role": "user", "content": "hi"}],
                                      extra_body={"lora": [{"id": 0, "scale": 1.0}]}, **KW)
    assert chat.choices[0].message.content == again.choices[0].message.content


def test_listings(server, files):
    """/v1/models lists each adapter with its model as parent; Ollama's /api/tags lists "BASE:ADAPTER",
    and /api/generate on it answers as the chat route does with the adapter."""
    tiny, ads = files
    c = client(server)
    cards = {m.id: m for m in c.models.list().data}
    assert {tiny, "a", "b"} <= set(cards) and cards["a"].model_extra.get("parent") == tiny
    assert c.models.retrieve("a").id == "a"
    tags = httpx.get(server + "/api/tags", timeout=30).json()["models"]
    lora = {m["name"]: m for m in tags if m["details"].get("parent_model") == tiny}
    assert set(lora) == {f"{tiny}:a", f"{tiny}:b"} and lora[f"{tiny}:a"]["size"] == Path(ads["a"]).stat().st_size
    r = httpx.post(server + "/api/chat", timeout=60, json=dict(
        model=f"{tiny}:a", messages=[{"role": "user", "content": "hi"}], stream=False,
        options=dict(temperature=0, num_predict=12))).json()
    want = c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], **KW)
    assert r["message"]["content"] == want.choices[0].message.content


def test_errors(server, files):
    """An unknown adapter in the model name: 404 naming it; a lora id out of range or an unknown name:
    400 naming it; the server serves on."""
    tiny, _ = files
    c = client(server)
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'zzz'"):
        _text(c, f"{tiny}:zzz")
    with pytest.raises(openai.NotFoundError):
        _text(c, "zzz")
    with pytest.raises(openai.BadRequestError, match="lora id 5"):
        _text(c, tiny, lora=[{"id": 5, "scale": 1.0}])
    with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'nope'"):
        _text(c, tiny, lora=[{"name": "nope", "scale": 1.0}])
    with pytest.raises(openai.BadRequestError, match="lora entry"):
        _text(c, tiny, lora=[{"scale": 1.0}])
    assert _text(c, "a") == _text(c, f"{tiny}:a")


def test_generate_cli_applies_its_lora(server, files):
    """`hearthlm generate --lora a=PATH` applies a (scale 1, as llama-cli): its text is the server's
    for model "a". Mutation: _generate leaving adapters out fails it."""
    import subprocess
    tiny, ads = files
    out = subprocess.run([sys.executable, "-m", "hearthlm", "generate", "--model", tiny, "hello there", "--max-tokens",
                          "12", "--temperature", "0", "--lora", f"a={ads['a']}"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    c = client(server)
    assert out.stdout[:-1] == _text(c, "a") != _text(c, tiny)
