"""The ASGI middleware that counts and times every request into the app's Metrics."""

from __future__ import annotations

import time

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixrag.app.services.metrics import Metrics


class MetricsMiddleware:
    """Counts requests and times them by route template (not raw path, to bound cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            elapsed = time.perf_counter() - started
            self.metrics.observe_request(route, scope["method"], status, elapsed)


def install_metrics(app: FastAPI, metrics: Metrics) -> None:
    """Count and time every request of `app` into `metrics`."""
    app.add_middleware(MetricsMiddleware, metrics=metrics)
