"""The ask path: retrieve (through the search service), build the prompt, generate.

`prepare_answer` does everything up to the engine call and raises ServiceError on bad input;
the caller then streams `answer_stream(...)` and shapes the result with the helpers below, so
/v1/query and the `prefixrag-rag` chat model share one pipeline.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.prompting import BuiltPrompt, PromptBuilder, Source
from app.qa_schemas import CitationOut, QueryIn, UsageOut
from app.schemas import SearchHitOut, SearchIn
from app.services.errors import InvalidInputError, NotReadyError
from app.services.llm import LLMService
from app.services.search import search
from engine.outputs import GenerationDelta, GenerationResult
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from app.state import AppState


@dataclass(slots=True)
class PreparedAnswer:
    """A question retrieved and laid out, ready to generate."""

    prompt: BuiltPrompt
    params: SamplingParams
    retrieval_ms: dict[str, float]
    started: float  # time.perf_counter() when the request arrived


async def prepare_answer(state: AppState, query: QueryIn) -> PreparedAnswer:
    """Check limits, retrieve the top_k sources and build the prompt (dropping the lowest-ranked
    sources if it would not fit next to max_tokens). Raises ServiceError subclasses."""
    started = time.perf_counter()
    settings = state.settings
    if len(query.question) > settings.max_question_chars:
        raise InvalidInputError(
            f"question has {len(query.question)} characters; at most "
            f"{settings.max_question_chars} are allowed"
        )
    max_tokens = query.max_tokens or settings.default_max_tokens
    if max_tokens > settings.max_tokens_cap:
        raise InvalidInputError(
            f"max_tokens must be at most {settings.max_tokens_cap}, got {max_tokens}"
        )
    llm, builder = _require_pipeline(state)
    params = SamplingParams(max_tokens=max_tokens, temperature=query.temperature)
    hits, timings = await run_in_threadpool(_retrieve, state, query)
    if state.metrics is not None:
        state.metrics.observe_retrieval(timings)
    room = llm.max_model_len - max_tokens
    prompt = builder.build(query.question, [to_source(h) for h in hits], max_prompt_tokens=room)
    return PreparedAnswer(prompt, params, timings, started)


def answer_stream(
    state: AppState, prepared: PreparedAnswer
) -> AsyncIterator[GenerationDelta | GenerationResult]:
    """The engine's stream for a prepared answer; closing it early aborts the generation."""
    llm, _ = _require_pipeline(state)
    return llm.generate(prepared.prompt.token_ids, prepared.params)


def citations(prepared: PreparedAnswer) -> list[CitationOut]:
    """The sources in prompt order, numbered as the prompt numbers them."""
    return [
        CitationOut(
            n=n,
            document_id=s.document_id,
            chunk_id=s.chunk_id,
            title=s.title,
            text=s.text,
            start=s.start,
            end=s.end,
            page=s.page,
            score=s.score,
        )
        for n, s in enumerate(prepared.prompt.sources, start=1)
    ]


def usage(result: GenerationResult) -> UsageOut:
    return UsageOut(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
    )


def timings(prepared: PreparedAnswer, result: GenerationResult) -> dict[str, float]:
    """Retrieval stages, TTFT and TPOT of the engine, and the whole request, in ms."""
    return {
        "embed_ms": prepared.retrieval_ms.get("embed_ms", 0.0),
        "search_ms": prepared.retrieval_ms.get("search_ms", 0.0),
        "rerank_ms": prepared.retrieval_ms.get("rerank_ms", 0.0),
        "ttft_ms": result.ttft_s * 1000.0,
        "tpot_ms": result.tpot_s * 1000.0,
        "total_ms": (time.perf_counter() - prepared.started) * 1000.0,
    }


def record_result(state: AppState, result: GenerationResult) -> None:
    """Feed a finished generation's TTFT and TPOT to the metrics."""
    if state.metrics is not None:
        state.metrics.observe_generation(result)


def to_source(hit: SearchHitOut) -> Source:
    """A search hit as a prompt source; the rerank score wins when there is one."""
    score = hit.rerank_score if hit.rerank_score is not None else hit.score
    return Source(
        chunk_id=hit.chunk_id,
        document_id=hit.document_id,
        title=hit.title,
        text=hit.text,
        start=hit.start,
        end=hit.end,
        page=hit.page,
        score=score,
    )


def _retrieve(state: AppState, query: QueryIn) -> tuple[list[SearchHitOut], dict[str, float]]:
    settings = state.settings
    if state.sessions is None or state.retriever is None:
        raise NotReadyError("retrieval is not ready")
    top_k = query.top_k or settings.default_top_k
    try:
        request = SearchIn(
            query=query.question,
            top_k=top_k,
            candidates=max(query.candidates or settings.default_candidates, top_k),
            collection=query.collection,
            document_ids=query.document_ids,
        )
    except ValidationError as exc:
        raise InvalidInputError(f"cannot search for this question: {exc}") from exc
    found = search(state.sessions, state.retriever, request)
    return found.results, dict(found.timings)


def _require_pipeline(state: AppState) -> tuple[LLMService, PromptBuilder]:
    state.require("db", "embedder", "index", "llm")
    if state.llm is None or state.prompts is None:
        raise NotReadyError("the Q&A pipeline is not ready (prompt builder not loaded)")
    return state.llm, state.prompts
