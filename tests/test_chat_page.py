"""The chat page at / of `hearthlm serve`, in a real headless Chromium (Debian's `chromium`,
driven by Playwright; no browser download): models listed, answers streamed and equal to the
API's, Stop aborting the request on the server, the conversation sent whole, model output
shown as text, errors shown, and no request going anywhere but this server. Images: attached
with the file picker, a paste or a drop, sent as data: URLs in image_url parts to a tiny
Gemma 3 vision model, shown in the user's bubble, refused in the page past its size limit.
HEARTHLM_CHAT_SCREENSHOT=PATH also writes a screenshot of a conversation there."""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from serve_util import live_server, metrics, wait_for
from tiny_gguf import write_tiny

KEY = "sk-page-key"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
LAST = ".assistant:last-of-type"
VISION = str(Path(__file__).parent / "data" / "converted" / "gemma3-vision.gguf")  # its mmproj lies beside it
# waits go through selectors: wait_for_function evaluates a string, which the page's CSP forbids


def _missing(reason: str):
    if os.environ.get("HEARTHLM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (HEARTHLM_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install 'playwright>=1.40')")
    if shutil.which("chromium") is None:
        _missing("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("page") / "tiny.gguf", context_length=8192))


@pytest.fixture(scope="module")
def server(tiny):
    with live_server(tiny, "--n-ctx", "8192", "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def vserver():
    with live_server(VISION, "--n-ctx", "2048", "--api-key", KEY) as url:
        yield url


@pytest.fixture
def page(browser, server):
    with open_page(browser, server) as pg:
        yield pg


@pytest.fixture
def vpage(browser, vserver):
    with open_page(browser, vserver) as pg:
        yield pg


@contextmanager
def open_page(browser, server):
    """A fresh page with the key typed in and the settings made deterministic; every request
    it makes is recorded and must go to this server."""
    ctx = browser.new_context(viewport={"width": 420, "height": 720})  # a phone's width
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    requests = []
    pg.on("request", lambda r: requests.append(r))
    pg.goto(server + "/")
    pg.wait_for_selector("#error:not([hidden])")  # the 401 opens the settings for the key
    assert pg.eval_on_selector("#settings", "d => d.open") is True
    pg.fill("#key", KEY)
    pg.dispatch_event("#key", "change")
    pg.fill("#temperature", "0")
    pg.locator("#model option").first.wait_for(state="attached")
    pg.requests = requests
    yield pg
    hosts = {urlsplit(r.url).hostname for r in requests}
    ctx.close()
    assert hosts == {"127.0.0.1"}, hosts


def api_answer(server, model, messages, max_tokens):
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json=dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0))
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def say(pg, text):
    """Type a message, send it with Enter, and return the finished answer bubble's state and text."""
    pg.fill("#input", text)
    pg.press("#input", "Enter")
    pg.wait_for_selector(f"{LAST}[data-state]:not([data-state=streaming])")
    return pg.get_attribute(LAST, "data-state"), content(pg)


def content(pg) -> str:  # textContent: the answer exactly, whitespace and all
    return pg.eval_on_selector(f"{LAST} .content", "e => e.textContent")


def sent_bodies(pg) -> list[dict]:
    return [json.loads(r.post_data) for r in pg.requests if r.url.endswith("/v1/chat/completions")]


def test_page_needs_no_key_and_fetches_nothing_else(browser, server, tiny):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert "http://" not in r.text and "https://" not in r.text  # no CDN, no font, no script from elsewhere
    assert httpx.get(server + "/v1/models").status_code == 401  # the API still wants the key
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.goto(server + "/")
    pg.wait_for_selector("#error:not([hidden])")
    assert "API key" in pg.inner_text("#error")  # the server's 401 message, shown
    pg.fill("#key", KEY)
    pg.dispatch_event("#key", "change")
    pg.locator("#model option").first.wait_for(state="attached")
    assert pg.is_hidden("#error")
    pg.reload()  # the key is remembered (localStorage): the models come without typing it again
    pg.locator("#model option").first.wait_for(state="attached")
    assert pg.eval_on_selector("#model", "s => [...s.options].map(o => o.value)") == [tiny]
    ctx.close()


def test_answers_stream_and_match_the_api(page, server, tiny):
    page.fill("#max-tokens", "12")
    state, first = say(page, "hello")
    assert state == "done" and first == api_answer(server, tiny, [{"role": "user", "content": "hello"}], 12)
    assert len(first) > 0
    page.fill("#system", "be brief")
    state, second = say(page, "and again")
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
             {"role": "assistant", "content": first}, {"role": "user", "content": "and again"}]
    body = sent_bodies(page)[-1]
    assert body["messages"] == convo and body["stream"] is True  # the whole conversation, each turn
    assert body["temperature"] == 0 and body["max_tokens"] == 12
    assert state == "done" and second == api_answer(server, tiny, convo, 12)
    assert page.locator(".msg").count() == 4
    if os.environ.get("HEARTHLM_CHAT_SCREENSHOT"):
        page.screenshot(path=os.environ["HEARTHLM_CHAT_SCREENSHOT"])
    page.click("#new")  # a new chat sends only its own message
    say(page, "hello")
    assert sent_bodies(page)[-1]["messages"] == convo[:2] and page.locator(".msg").count() == 2


def test_stop_aborts_the_request(page, server):
    """Stop mid-answer: the text stops growing, the server aborts the request (it generated
    fewer tokens than asked) and holds no KV blocks afterwards."""
    before = metrics(server)["hearthlm_generated_tokens_total"]
    page.fill("#max-tokens", "8000")  # seconds of work even for the tiny model
    page.fill("#input", "go on and on")
    page.click("#send")
    page.wait_for_selector(f"{LAST} .content:not(:empty)")
    page.click("#stop")
    page.wait_for_selector(f"{LAST}[data-state=stopped]", timeout=10_000)
    stopped = content(page)
    time.sleep(0.5)
    assert content(page) == stopped != "" and "(stopped)" in page.inner_text(LAST)
    assert wait_for(lambda: metrics(server)["hearthlm_running_requests"] == 0, timeout=10)
    m = metrics(server)
    assert m["hearthlm_kv_blocks_used"] == 0
    assert m["hearthlm_generated_tokens_total"] - before < 8000
    # the stopped answer stays in the conversation as far as it came
    page.fill("#max-tokens", "4")
    say(page, "next")
    assert sent_bodies(page)[-1]["messages"][1] == {"role": "assistant", "content": stopped}


def test_markup_and_thinking_are_text(page):
    """Model output is text, never markup: the server's stream is replaced with one whose
    content and reasoning_content hold HTML."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "<i>hmm</i>"}}]},
              {"choices": [{"index": 0, "delta": {"content": "<b>x</b>"}}]},
              {"choices": [{"index": 0, "delta": {"content": "<img src=x onerror=alert(1)>"}, "finish_reason": "stop"}]}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    state, text = say(page, "markup please")
    assert state == "done" and text == "<b>x</b><img src=x onerror=alert(1)>"
    assert page.locator("#log b, #log img, #log i").count() == 0
    assert page.is_visible(f"{LAST} .thinking summary")
    assert page.eval_on_selector(f"{LAST} .thinking div", "e => e.textContent") == "<i>hmm</i>"
    assert page.eval_on_selector(f"{LAST} .thinking", "e => e.open") is False  # folded once the answer came


def test_server_errors_are_shown(page, server, tiny):
    """An error status (here: max_tokens past the context) shows the server's message; the
    turn is taken back and its text returned to the input."""
    page.fill("#max-tokens", "100000")
    page.fill("#input", "too long an answer")
    page.press("#input", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    assert "context" in page.inner_text("#error")
    assert page.locator(".msg").count() == 0 and page.input_value("#input") == "too long an answer"
    # an error event in the middle of a stream is shown too, the partial answer kept
    sse = ('data: {"choices": [{"index": 0, "delta": {"content": "part"}}]}\n\n'
           'data: {"error": {"message": "the engine failed", "type": "server_error"}}\n\n')
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    state, text = say(page, "x")
    assert state == "error" and text == "part" and "the engine failed" in page.inner_text("#error")


# ---- images ------------------------------------------------------------------------------

def png(color, size=(24, 16)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def png_file(tmp_path, name, color) -> Path:
    p = tmp_path / name
    p.write_bytes(png(color))
    return p


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


# A File made in the page and handed over as a paste's clipboard or a drop's data transfer;
# returns whether the event's default action was prevented (dispatchEvent gives false then).
DISPATCH = """([kind, b64, name, type, size]) => {
  const bytes = b64 ? Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)) : new Uint8Array(size);
  const dt = new DataTransfer();
  dt.items.add(new File([bytes], name, {type}));
  const init = {bubbles: true, cancelable: true};
  const target = document.getElementById("input");
  if (kind === "paste") return !target.dispatchEvent(new ClipboardEvent("paste", {...init, clipboardData: dt}));
  return !target.dispatchEvent(new DragEvent(kind, {...init, dataTransfer: dt}));
}"""


def dispatch(pg, kind, data=b"", name="x.png", type="image/png", size=0) -> bool:
    return pg.evaluate(DISPATCH, [kind, base64.b64encode(data).decode(), name, type, size])


def tray(pg) -> list[str]:
    """The src of each thumbnail waiting to be sent."""
    return pg.eval_on_selector_all("#tray img", "imgs => imgs.map((i) => i.src)")


def test_image_from_the_picker_is_sent_shown_and_answered(vpage, vserver, tmp_path):
    """An image picked with the file input goes as an image_url part (a data: URL of the file's
    own bytes) before the text; it shows in the user's bubble (the CSP lets the data: URL load);
    the streamed answer equals the API's; the next turn sends the image again with the history.
    Mutations: the image part left out of the message, the CSP without img-src data:, the
    history sent with its image parts stripped, each fail it."""
    f = png_file(tmp_path, "red.png", (220, 30, 40))
    vpage.fill("#max-tokens", "6")
    vpage.set_input_files("#file", str(f))
    vpage.wait_for_selector("#tray img")
    assert vpage.is_visible("#tray") and tray(vpage) == [image_part(f.read_bytes())["image_url"]["url"]]
    state, first = say(vpage, "what is this?")
    turn = {"role": "user", "content": [image_part(f.read_bytes()), {"type": "text", "text": "what is this?"}]}
    assert sent_bodies(vpage)[-1]["messages"] == [turn]
    assert state == "done" and first == api_answer(vserver, VISION, [turn], 6) and first
    assert vpage.is_hidden("#tray") and tray(vpage) == []  # the attachments went with the message
    shown = vpage.eval_on_selector_all(".user img", "imgs => imgs.map((i) => [i.src, i.naturalWidth])")
    assert shown == [[turn["content"][0]["image_url"]["url"], 24]]  # loaded: 24 pixels wide, as the file
    assert vpage.inner_text(".user") == "what is this?"
    state, second = say(vpage, "and now?")
    convo = [turn, {"role": "assistant", "content": first}, {"role": "user", "content": "and now?"}]
    assert sent_bodies(vpage)[-1]["messages"] == convo
    assert state == "done" and second == api_answer(vserver, VISION, convo, 6)


def test_paste_and_drop_attach_images(vpage):
    """A pasted image and a dropped one both wait in the tray, in that order, and go together
    in one message; a drag of files over the page is taken (the browser would otherwise open the
    file in place of the page). Mutations: no paste listener; no drop listener; dragover not
    prevented, each fail it."""
    a, b = png((0, 200, 0)), png((0, 0, 200), size=(8, 8))
    dispatch(vpage, "paste", a)  # not prevented: any text in a clipboard still pastes as text
    vpage.wait_for_selector("#tray .thumb >> nth=0")
    assert dispatch(vpage, "dragover", b) is True
    assert dispatch(vpage, "drop", b, name="b.png") is True
    vpage.wait_for_selector("#tray .thumb >> nth=1")
    assert tray(vpage) == [image_part(a)["image_url"]["url"], image_part(b)["image_url"]["url"]]
    vpage.fill("#max-tokens", "2")
    state, _ = say(vpage, "two")
    assert state == "done" and vpage.locator(".user img").count() == 2
    assert sent_bodies(vpage)[-1]["messages"][0]["content"] == [image_part(a), image_part(b), {"type": "text", "text": "two"}]


def test_attachment_removed_before_sending(vpage, tmp_path):
    """Of two images picked at once, the one removed from the tray is not sent; a message of
    images alone (no text) is sent as image parts only. Mutation: the remove button taking the
    thumbnail off but not the image (or the other image) fails it."""
    red, blue = png_file(tmp_path, "red.png", (220, 30, 40)), png_file(tmp_path, "blue.png", (20, 30, 240))
    vpage.set_input_files("#file", [str(red), str(blue)])
    vpage.wait_for_selector("#tray .thumb >> nth=1")
    vpage.click("#tray button[aria-label='Remove red.png']")
    assert tray(vpage) == [image_part(blue.read_bytes())["image_url"]["url"]]
    vpage.fill("#max-tokens", "2")
    vpage.click("#send")
    vpage.wait_for_selector(f"{LAST}[data-state]:not([data-state=streaming])")
    assert sent_bodies(vpage)[-1]["messages"] == [{"role": "user", "content": [image_part(blue.read_bytes())]}]
    assert vpage.get_attribute(LAST, "data-state") == "done"


def test_too_big_or_not_an_image_is_refused_in_the_page(vpage):
    """A file over 20 MB or not an image is refused with a message naming it, and nothing is
    attached or sent. Mutations: no size check; no type check, each fail it."""
    dispatch(vpage, "drop", name="huge.png", size=20 * 2**20 + 1)
    vpage.wait_for_selector("#error:not([hidden])")
    assert "huge.png" in vpage.inner_text("#error") and "20 MB" in vpage.inner_text("#error")
    dispatch(vpage, "drop", b"hello", name="notes.txt", type="text/plain")
    vpage.wait_for_selector("#error:has-text('notes.txt')")
    assert "not an image" in vpage.inner_text("#error")
    assert tray(vpage) == [] and vpage.is_hidden("#tray") and sent_bodies(vpage) == []


def test_image_to_a_text_only_model_shows_the_servers_error(page, tmp_path):
    """The text-only model answers an image with a 400 saying it has no vision projector: the
    page shows it, takes the turn back and returns both the text and the image to the input; a
    413 (the conversation with its images too big) is shown with a hint. Mutations: the images
    not returned on a failed turn; the 400's message not shown, each fail it."""
    f = png_file(tmp_path, "red.png", (220, 30, 40))
    page.set_input_files("#file", str(f))
    page.wait_for_selector("#tray img")
    page.fill("#input", "see this")
    page.press("#input", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    assert "vision projector" in page.inner_text("#error")
    assert page.locator(".msg").count() == 0 and page.input_value("#input") == "see this"
    assert tray(page) == [image_part(f.read_bytes())["image_url"]["url"]]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=413, headers={"Content-Type": "application/json"},
        body=json.dumps({"error": {"message": "the request body is over 16777216 bytes"}})))
    page.press("#input", "Enter")
    page.wait_for_selector("#error:has-text('16777216')")
    assert "start a new chat or send smaller images" in page.inner_text("#error")
