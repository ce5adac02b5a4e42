"""Server-sent events: the framing of both stream kinds (OpenAI's unnamed `data:` events and our
named events), the response headers, and running a stream to its end unless the client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from prefixrag.engine.outputs import GenerationDelta, GenerationResult

# Proxies must pass each event on at once, not buffer the stream.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# OpenAI's last event of a stream.
DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def data_event(payload: dict[str, Any]) -> str:
    """One unnamed server-sent event carrying a JSON payload (OpenAI's stream framing)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def named_event(event: str, data: dict[str, Any]) -> str:
    """One named server-sent event with a JSON payload (our /v1/query stream)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The HTTP response that streams `events` as they come."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def collect_until_disconnect(
    request: Request, stream: AsyncIterator[GenerationDelta | GenerationResult]
) -> GenerationResult | None:
    """Run a generation to its end, or abort it (freeing its KV blocks) if the client leaves."""

    async def final() -> GenerationResult:
        result = None
        async for item in stream:
            if isinstance(item, GenerationResult):
                result = item
        if result is None:
            raise RuntimeError("generation ended without a result")
        return result

    return await until_disconnect(request, final())


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, or cancel it (which closes its engine streams, aborting their requests)
    and return None if the client leaves first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gen_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({gen_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not gen_task.done():
            gen_task.cancel()  # closes the engine stream, which aborts the request
    if gen_task.cancelled():
        return None
    return gen_task.result()
