"""Images through `hearthlm serve`'s doors with the official clients (#39): OpenAI chat completions'
image_url parts and Ollama's `images` on /api/chat and /api/generate, against a live server serving
the tiny Gemma 3 vision model (its mmproj found beside it) and a text-only model; each bad image a
400 that names it, and no request can make the server read its own files or reach the network."""
from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
PIL = pytest.importorskip("PIL.Image")

from serve_util import live_server  # noqa: E402
from tiny_gguf import write_tiny  # noqa: E402

KEY = "sk-vision-test"
VISION = Path(__file__).parent / "data" / "converted" / "gemma3-vision.gguf"
N_IMAGE = 16 + 2  # the tiny tower's rows, and <start_of_image> / <end_of_image>


def png(seed: int = 0, size=(48, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def bomb() -> bytes:
    """A valid PNG header claiming 100000 x 100000 pixels (a decompression bomb's shape), no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def data_url(b: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(b).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    text = write_tiny(tmp_path_factory.mktemp("vision") / "text.gguf")
    with live_server(f"see={VISION}", f"text={text}", "--api-key", KEY, "--n-ctx", "512") as url:
        yield url


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(image_part=None, text="What is this?"):
    content = ([image_part] if image_part else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def test_openai_image_url(server):
    """An image_url part counts its rows and markers in the prompt, and the answer is the one the
    same messages give in-process (temperature 0). Mutation: the route dropping image parts fails
    the count; decoding the data URL wrongly fails the answer."""
    from hearthlm import SyncSession
    c = oai(server)
    url = data_url(png())
    with_image = c.chat.completions.create(model="see", messages=ask({"type": "image_url", "image_url": {"url": url}}),
                                           max_tokens=6, temperature=0)
    plain = c.chat.completions.create(model="see", messages=ask(), max_tokens=6, temperature=0)
    assert with_image.usage.prompt_tokens == plain.usage.prompt_tokens + N_IMAGE
    s = SyncSession(str(VISION), n_ctx=512)
    try:
        want = s.generate(messages=ask({"type": "image_url", "image_url": {"url": url}}), max_tokens=6, temperature=0)
    finally:
        s.close()
    assert with_image.choices[0].message.content == want.text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="see", messages=ask({"type": "image_url", "image_url": {"url": url}}), max_tokens=6, temperature=0,
        stream=True) if ch.choices)
    assert streamed == want.text


@pytest.mark.parametrize("url,says", [
    ("/etc/passwd", "data: URL or an http\\(s\\) URL"),
    ("file:///etc/passwd", "data: URL or an http\\(s\\) URL"),
    ("http://127.0.0.1:9/x.png", "remote"),
    ("data:image/png;base64,!!!notbase64", "image 1"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "image 1"),
    (data_url(bomb()), "image 1.*pixels"),
])
def test_openai_bad_images_are_400s_that_name_them(server, url, says):
    """Mutations: reading a path from a request, fetching without allow_remote_media, or decoding a
    bomb before checking its size, each fail a case."""
    with pytest.raises(openai.BadRequestError, match=says):
        oai(server).chat.completions.create(model="see", max_tokens=2,
                                            messages=ask({"type": "image_url", "image_url": {"url": url}}))


def test_text_model_refuses_images(server):
    """Mutation: a model without an mmproj silently ignoring the image fails it."""
    with pytest.raises(openai.BadRequestError, match="no vision projector"):
        oai(server).chat.completions.create(model="text", max_tokens=2,
                                            messages=ask({"type": "image_url", "image_url": {"url": data_url(png())}}))


def test_ollama_chat_and_generate_images(server):
    """Ollama's images (base64, from bytes or a path on the client's side) on /api/chat and
    /api/generate: counted in prompt_eval_count, and chat's answer equals the OpenAI route's for the
    image before the text. Mutation: images placed after the text fail the equality."""
    cl = ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    img = png(1)
    opts = {"temperature": 0, "num_predict": 6}
    chat = cl.chat(model="see", messages=[{"role": "user", "content": "What is this?", "images": [img]}], options=opts)
    plain = cl.chat(model="see", messages=[{"role": "user", "content": "What is this?"}], options=opts)
    assert chat.prompt_eval_count == plain.prompt_eval_count + N_IMAGE
    want = oai(server).chat.completions.create(
        model="see", messages=ask({"type": "image_url", "image_url": {"url": data_url(img)}}), max_tokens=6,
        temperature=0)
    assert chat.message.content == want.choices[0].message.content
    gen = cl.generate(model="see", prompt="What is this?", images=[img], options=opts)
    assert gen.prompt_eval_count == plain.prompt_eval_count + N_IMAGE
    raw = cl.generate(model="see", prompt="Look:", images=[img, png(2)], raw=True, options=opts)
    assert raw.prompt_eval_count >= 2 * N_IMAGE


def test_ollama_bad_image(server):
    cl = ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    with pytest.raises(ollama.ResponseError) as e:
        cl.chat(model="see", messages=[{"role": "user", "content": "x", "images": [bomb()]}])
    assert e.value.status_code == 400 and "image 1" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        cl.chat(model="text", messages=[{"role": "user", "content": "x", "images": [png()]}])
    assert e.value.status_code == 400 and "no vision projector" in str(e.value)


def test_remote_images_only_where_the_server_allows(tmp_path):
    """With --allow-remote-media an http URL is fetched (here from a local server) and answers as the
    same image sent inline; without it the URL is refused (test above). Mutation: the serve flag not
    reaching the Session's option fails it."""
    import http.server
    import threading
    (tmp_path / "img.png").write_bytes(png(4))
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with live_server(f"see={VISION}", "--n-ctx", "512", "--allow-remote-media") as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            remote = f"http://127.0.0.1:{httpd.server_address[1]}/img.png"
            got = c.chat.completions.create(model="see", max_tokens=5, temperature=0,
                                            messages=ask({"type": "image_url", "image_url": {"url": remote}}))
            want = c.chat.completions.create(model="see", max_tokens=5, temperature=0,
                                             messages=ask({"type": "image_url", "image_url": {"url": data_url(png(4))}}))
            assert got.choices[0].message.content == want.choices[0].message.content
            assert got.usage.prompt_tokens == want.usage.prompt_tokens
    finally:
        httpd.shutdown()
