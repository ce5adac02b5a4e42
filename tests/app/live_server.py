"""A real uvicorn server on a free loopback port, for clients that speak HTTP (openai, httpx)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(app: FastAPI, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Serve ``app`` on a thread; yields the base URL once /readyz says 200."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"server at {base} never became ready")
            # NOTE: polling a readiness endpoint, not hiding a race: readiness is the contract.
            time.sleep(0.2)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)
