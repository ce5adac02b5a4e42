"""POST /v1/query: a grounded answer with citations, as JSON or as server-sent events.

Stream events, in order: `citations` (once, with the `chunk_ids` this turn added and the
`dropped_chunks`/`dropped_turns` counts), `delta` (per decoded text piece), then `done` with the
answer, usage, timings, finish_reason and grounding (services/grounding.py), or `error` if
generation fails after the stream started. A follow-up question sends the earlier turns back
in `history`. A client that disconnects aborts the generation and frees its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prefixrag.app.api.deps import StateDep, TenantDep
from prefixrag.app.api.sse import collect_until_disconnect, event_stream, named_event
from prefixrag.app.schemas.errors import COMMON_CODES, error_responses, event_stream_response
from prefixrag.app.schemas.query import QueryIn, QueryOut
from prefixrag.app.services import qa
from prefixrag.app.services.grounding import assess
from prefixrag.engine.outputs import GenerationDelta, GenerationResult

router = APIRouter(prefix="/v1", tags=["query"], responses=error_responses(*COMMON_CODES))
logger = logging.getLogger(__name__)


@router.post(
    "/query",
    response_model=QueryOut,
    responses={**event_stream_response("the answer"), **error_responses(404, 429)},
)
async def query(body: QueryIn, request: Request, state: StateDep, tenant: TenantDep) -> Any:
    """Retrieve, build the prompt and answer; `stream: true` answers with SSE events."""
    # Asked for here, not as a dependency: a malformed body is 422 even while the LLM loads.
    pipeline = state.qa_pipeline()
    prepared = await qa.prepare_answer(pipeline=pipeline, query=body, tenant=tenant)
    stream = qa.answer_stream(pipeline=pipeline, prepared=prepared)
    if body.stream:
        return event_stream(query_events(prepared, stream, state.settings.grounded_min_score))
    result = await collect_until_disconnect(request, stream)
    if result is None:  # the client went away; nobody reads a response
        return JSONResponse({"detail": "client disconnected"}, status_code=499)
    cited = qa.citations(prepared)
    return QueryOut(
        answer=result.text,
        citations=cited,
        chunk_ids=qa.chunk_ids(prepared),
        usage=qa.usage(result),
        timings=qa.timings(prepared, result),
        dropped_chunks=len(prepared.prompt.dropped),
        dropped_turns=prepared.prompt.dropped_turns,
        finish_reason=result.finish_reason,
        grounding=assess(result.text, cited, state.settings.grounded_min_score),
    )


async def query_events(
    prepared: qa.PreparedAnswer,
    stream: AsyncIterator[GenerationDelta | GenerationResult],
    min_score: float,
) -> AsyncIterator[str]:
    """The SSE body: citations, deltas, then done (or error)."""
    citations = qa.citations(prepared)
    cited = [c.model_dump() for c in citations]
    yield named_event(
        "citations",
        {
            "citations": cited,
            "chunk_ids": qa.chunk_ids(prepared),
            "dropped_chunks": len(prepared.prompt.dropped),
            "dropped_turns": prepared.prompt.dropped_turns,
        },
    )
    try:
        async for item in stream:
            if isinstance(item, GenerationDelta):
                if item.text:
                    yield named_event("delta", {"text": item.text})
                continue
            done = {
                "answer": item.text,
                "usage": qa.usage(item).model_dump(),
                "timings": qa.timings(prepared, item),
                "finish_reason": item.finish_reason,
                "grounding": assess(item.text, citations, min_score).model_dump(),
            }
            yield named_event("done", done)
    except Exception as exc:  # the stream has started: report in-band, not as a status code
        logger.exception("generation failed mid-stream")
        yield named_event("error", {"detail": f"generation failed: {exc}"})
    finally:
        # On a client disconnect this closes the engine stream, which aborts the request.
        await stream.aclose()  # type: ignore[attr-defined]
