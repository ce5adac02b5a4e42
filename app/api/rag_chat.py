"""The `prefixrag-rag` chat model: /v1/chat/completions answered by the Q&A pipeline.

The last user message is the question. The answer's message content ends with a short
"Sources:" block, so any OpenAI client shows where it came from; the structured sources are a
top-level "citations" list in the full response and in the final streamed chunk.

Multi-turn: each earlier user message with the assistant message that follows it is a turn of
the conversation's history (the newest MAX_HISTORY_TURNS of them; system messages are ignored,
the service has its own). The assistant's "Sources:" block is cut off again, and each earlier
question is retrieved again to recover the chunks its turn added: the index is unchanged between
turns, so the same question gets the same chunks, and the prompt repeats the earlier turns
exactly as they were (the prefix cache serves them). A document ingested or deleted between two
turns, or sources dropped to fit the context window, make the repeat differ: still a correct
prompt, only a shorter cache hit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from prefixrag.app.api.openai_shapes import ChatShape
from prefixrag.app.api.sse import DONE, collect_until_disconnect, data_event, event_stream
from prefixrag.app.core.errors import OpenAIError, ServiceError
from prefixrag.app.schemas.openai import ChatCompletionRequest, error_body
from prefixrag.app.schemas.query import MAX_HISTORY_TURNS, CitationOut, QueryIn, TurnIn
from prefixrag.app.services import qa
from prefixrag.app.state import AppState
from prefixrag.engine.outputs import GenerationDelta, GenerationResult

RAG_MODEL = "prefixrag-rag"
SOURCES_MARK = "\n\nSources:\n"


async def rag_chat_completion(
    request: Request, body: ChatCompletionRequest, state: AppState, tenant: str
) -> Any:
    """Answer the last user message from the documents, in OpenAI's chat shape."""
    # One answer per question, as text: refused, not ignored, for the Q&A model.
    if body.n != 1:
        raise OpenAIError(f"n: {RAG_MODEL} gives one choice; n must be 1", 422, "n")
    if body.logprobs:
        raise OpenAIError(f"logprobs: not available for {RAG_MODEL}", 422, "logprobs")
    try:
        pipeline = state.qa_pipeline()
    except ServiceError as exc:
        raise OpenAIError(str(exc), exc.status_code) from exc
    prepared = await _prepare(pipeline, body, tenant)
    cited = qa.citations(prepared)
    shape = ChatShape(RAG_MODEL)
    stream = qa.answer_stream(pipeline=pipeline, prepared=prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_chat_events(stream, shape, cited, include_usage))
    result = await collect_until_disconnect(request, stream)
    if result is None:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    response = shape.full(result)
    response["choices"][0]["message"]["content"] = result.text + sources_block(cited)
    response["citations"] = [c.model_dump() for c in cited]
    return response


def sources_block(cited: list[CitationOut]) -> str:
    """The sources as text appended to the answer ("" when there are none): a "[n] title" line
    per source, then its best evidence span quoted on an indented line."""
    if not cited:
        return ""
    lines = []
    for c in cited:
        lines.append(f"[{c.n}] {c.title}" + ("" if c.page is None else f", page {c.page}"))
        if c.evidence:
            lines.append(f"    > {c.evidence[0].one_line()}")
    return SOURCES_MARK + "\n".join(lines)


async def _prepare(
    pipeline: qa.QAPipeline, body: ChatCompletionRequest, tenant: str
) -> qa.PreparedAnswer:
    question, pairs = conversation(body)
    try:
        questions = [q for q, _ in pairs]
        chunk_ids = await qa.recover_chunk_ids(
            pipeline=pipeline, questions=questions, tenant=tenant
        )
        history = [
            TurnIn(question=q, answer=a, chunk_ids=ids)
            for (q, a), ids in zip(pairs, chunk_ids, strict=True)
        ]
        query = QueryIn(
            question=question,
            collection=None,
            document_ids=None,
            top_k=None,
            candidates=None,
            max_tokens=body.wanted_max_tokens(),
            temperature=body.temperature,
            history=history,
            **body.sampling_fields(),
        )
        return await qa.prepare_answer(pipeline=pipeline, query=query, tenant=tenant)
    except ValidationError as exc:
        raise OpenAIError(str(exc), 422, "messages") from exc
    except ServiceError as exc:
        raise OpenAIError(str(exc), exc.status_code) from exc


def conversation(body: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
    """The last user message, and the (question, answer) turns before it, oldest first: each
    user message answered by the next assistant message, its Sources block cut off."""
    messages = [m for m in body.messages if m.role in ("user", "assistant")]
    last = max(
        (i for i, m in enumerate(messages) if m.role == "user" and m.text().strip()), default=-1
    )
    if last < 0:
        raise OpenAIError("the conversation has no user message", param="messages")
    pairs: list[tuple[str, str]] = []
    for before, after in pairwise(messages[:last]):
        if before.role == "user" and after.role == "assistant" and before.text().strip():
            answer = after.text()
            if SOURCES_MARK in answer:
                answer = answer[: answer.rindex(SOURCES_MARK)]
            pairs.append((before.text(), answer))
    return messages[last].text(), pairs[-MAX_HISTORY_TURNS:]


async def _chat_events(
    stream: AsyncIterator[GenerationDelta | GenerationResult],
    shape: ChatShape,
    cited: list[CitationOut],
    include_usage: bool,
) -> AsyncIterator[str]:
    first = shape.start()
    if first is not None:
        yield data_event(first)
    try:
        async for item in stream:
            if isinstance(item, GenerationDelta):
                if item.text:
                    yield data_event(shape.delta(item.text))
                continue
            block = sources_block(cited)
            if block:
                yield data_event(shape.delta(block))
            last = shape.finish(item.finish_reason)
            last["citations"] = [c.model_dump() for c in cited]
            yield data_event(last)
            if include_usage:
                yield data_event(shape.usage_chunk(item))
    except Exception as exc:  # mid-stream: tell the client in-band
        yield data_event(error_body(f"generation failed: {exc}"))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield DONE
