"""Request body limits, enforced before a route reads the body: 413 with a JSON reason.

A declared Content-Length over the limit is refused without reading anything; a chunked body
is counted as it streams in and cut off at the limit, so no route ever buffers more than that.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixrag.app.core.settings import Settings
from prefixrag.app.schemas.openai import OPENAI_PATHS, error_body

UPLOAD_PATH = "/v1/documents"
# room for the multipart framing and form fields around an upload of max_upload_bytes
MULTIPART_OVERHEAD_BYTES = 64 * 1024


class BodyLimitMiddleware:
    """Refuses request bodies over `limit_for(path)` bytes with 413."""

    def __init__(self, app: ASGIApp, *, upload_bytes: int, request_bytes: int) -> None:
        self.app = app
        self.upload_bytes = upload_bytes + MULTIPART_OVERHEAD_BYTES
        self.request_bytes = request_bytes

    def limit_for(self, path: str) -> int:
        return self.upload_bytes if path.rstrip("/") == UPLOAD_PATH else self.request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(limit, declared, scope["path"])(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # HTTPException passes through FastAPI's body parsing unchanged, so the
                    # client gets the 413 whichever route was reading.
                    raise HTTPException(413, _message(limit, None))
            return message

        await self.app(scope, counted, send)


def install_body_limit(app: FastAPI, settings: Settings) -> None:
    """Add the body limits of `settings` to `app`."""
    app.add_middleware(
        BodyLimitMiddleware,
        upload_bytes=settings.max_upload_bytes,
        request_bytes=settings.max_request_bytes,
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _message(limit: int, declared: int | None) -> str:
    size = "" if declared is None else f" ({declared} bytes)"
    return f"request body too large{size}: the limit here is {limit} bytes"


def _too_large(limit: int, declared: int, path: str) -> Any:
    message = _message(limit, declared)
    if path in OPENAI_PATHS:
        return JSONResponse(error_body(message), status_code=413)
    return JSONResponse({"detail": message}, status_code=413)
