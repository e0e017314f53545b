"""The chat page at GET / : one static HTML file shipped as package data. Loading it needs no
API key (it holds no data); the API calls it makes carry the key the user types into it."""
from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse


@lru_cache(maxsize=1)
def chat_page() -> tuple[str, str]:
    """The HTML and its Content-Security-Policy: the page may talk to this server only, and
    only its own inline script and style run (by hash), so injected markup could do nothing.
    Images may come from data: URLs only: the thumbnails of images the user attached."""
    html = files("hearthlm.serve").joinpath("static/chat.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(m.encode()).digest()).decode()}'"
                        for m in re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S))
    csp = (f"default-src 'none'; connect-src 'self'; script-src {hashes('script')}; style-src {hashes('style')}; img-src data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


def add_chat_page(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        html, csp = chat_page()
        # no-store: after an upgrade the browser gets the new page, not a cached older one
        return HTMLResponse(html, headers={"Content-Security-Policy": csp, "Cache-Control": "no-store"})
