"""A small local HTTP server answering the Hugging Face Hub's API for one repo, enough for
huggingface_hub's list_repo_files and hf_hub_download (HF_ENDPOINT points at it). It can cut
a download's connection partway and refuse the next requests, to test resume."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class FakeHub:
    def __init__(self, repo: str, files: dict[str, bytes]) -> None:
        self.repo, self.files = repo, files
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_at: int | None = None   # the next full GET sends this many bytes, then drops the connection
        self.down_after_cut = False      # and from then on every request gets 503 (until reset)
        self.down = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        rng = h.headers.get("Range")
        self.log.append((h.command, path, rng))
        if self.down:
            return self._send(h, 503, b"down", "text/plain", body)
        tree = f"/api/models/{self.repo}/tree/"
        if path.startswith(tree):
            listing = [dict(type="file", path=n, size=len(b), oid=hashlib.sha1(b).hexdigest()) for n, b in self.files.items()]
            return self._send(h, 200, json.dumps(listing).encode(), "application/json", body)
        m = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/([^/]+)/(.+)", path)
        if not m or m.group(2) not in self.files:
            return self._send(h, 404, b'{"error": "not found"}', "application/json", body,
                              {"X-Error-Code": "EntryNotFound" if m else "RepositoryNotFound"})
        data = self.files[m.group(2)]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        start = int(re.match(r"bytes=(\d+)-", rng).group(1)) if rng else 0
        if not body:
            return self._send(h, 200, data, "application/octet-stream", False, headers)
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if self.cut_at is not None and not start:
            cut, self.cut_at = self.cut_at, None
            self.down = self.down_after_cut
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the connection is cut partway
            return
        self._send(h, 206 if start else 200, data[start:], "application/octet-stream", True, headers)

    @staticmethod
    def _send(h, status: int, data: bytes, ctype: str, body: bool, headers: dict | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
