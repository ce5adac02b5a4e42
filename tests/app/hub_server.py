"""A model hub on 127.0.0.1 with the Hugging Face URL layout that huggingface_hub reads:
``/<repo>/resolve/<rev>/<file>`` (HEAD and ranged GET, the file's sha256 as its etag, as the
hub gives large files) and ``/api/models/<repo>/tree/<rev>``. Faults on demand: a connection
that drops after some bytes, once or on every request."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/[^/?]+")


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # a GET of a file body stops after this many bytes (counted from the file's start)...
    cut_at: int | None = None
    # ...on this many requests (None: on every one)
    cuts_left: int | None = None
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.serve(self, body=False)

            def do_GET(self) -> None:
                hub.serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append((h.command, h.path, h.headers.get("Range")))
        if tree := _TREE.match(h.path):
            files = self.repos.get(tree.group(1))
            if files is None:
                return self._missing(h, "RepoNotFound")
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": _sha256(data)}
                for name, data in files.items()
            ]
            return self._send(h, 200, json.dumps(listing).encode(), {}, body)
        resolve = _RESOLVE.match(h.path)
        if resolve is None or resolve.group(1) not in self.repos:
            return self._missing(h, "RepoNotFound")
        data = self.repos[resolve.group(1)].get(resolve.group(2))
        if data is None:
            return self._missing(h, "EntryNotFound")
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{_sha256(data)}"',
            "Accept-Ranges": "bytes",
        }
        start = 0
        if ranged := re.match(r"bytes=(\d+)-", h.headers.get("Range") or ""):
            start = int(ranged.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        if not body or self.cut_at is None or self.cuts_left == 0:
            return self._send(h, status, data[start:], headers, body)
        if self.cuts_left is not None:
            self.cuts_left -= 1
        # the whole length promised, part of it sent, then the connection dropped
        h.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data) - start)}.items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(data[start : max(start, self.cut_at)])
        h.wfile.flush()
        h.connection.shutdown(socket.SHUT_RDWR)
        h.close_connection = True

    def _missing(self, h: BaseHTTPRequestHandler, code: str) -> None:
        self._send(h, 404, b"not found", {"X-Error-Code": code}, True)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool
    ) -> None:
        h.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(key, value)
        h.end_headers()
        if body:
            h.wfile.write(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
