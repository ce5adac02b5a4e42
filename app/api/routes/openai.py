"""OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions (SSE or not).

The chat route also serves the `prefixrag-rag` model, answered by the Q&A pipeline
(routes/rag_chat.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prefixrag.app.api.deps import LLMDep, StateDep, TenantDep, get_llm
from prefixrag.app.api.openai_shapes import ChatShape, CompletionShape, Shape
from prefixrag.app.api.rag_chat import RAG_MODEL, rag_chat_completion
from prefixrag.app.api.sse import DONE, collect_until_disconnect, data_event, event_stream
from prefixrag.app.core.errors import OpenAIError, ServiceError
from prefixrag.app.schemas.errors import COMMON_CODES, event_stream_response, openai_error_responses
from prefixrag.app.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    _GenerationRequest,
    error_body,
)
from prefixrag.app.services.llm import LLMService
from prefixrag.engine.cache_scope import CacheScope
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling_params import SamplingParams

router = APIRouter(prefix="/v1", tags=["openai"], responses=openai_error_responses(*COMMON_CODES))
# what a generation route answers besides COMMON_CODES
_GENERATION_RESPONSES = {
    **event_stream_response("the completion"),
    **openai_error_responses(404, 429),
}


@router.get("/models")
def list_models(state: StateDep) -> dict[str, Any]:
    names = ([state.llm.model_id] if state.llm is not None else []) + [RAG_MODEL]
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "prefixrag"}
            for name in names
        ],
    }


@router.post("/completions", responses=_GENERATION_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, llm: LLMDep, tenant: TenantDep
) -> Any:
    _check_model(body.model, llm)
    prompt_ids = body.prompt if isinstance(body.prompt, list) else llm.encode(body.prompt)
    if isinstance(body.prompt, list) and max(body.prompt) >= llm.engine.tokenizer.vocab_size:
        raise OpenAIError("prompt contains token ids outside the vocabulary", param="prompt")
    params = _sampling_params(body, llm, len(prompt_ids), body.max_tokens)
    shape = CompletionShape(llm.model_id)
    return await _respond(request, body, llm, prompt_ids, params, shape, tenant)


@router.post("/chat/completions", responses=_GENERATION_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Any:
    if body.model == RAG_MODEL:
        return await rag_chat_completion(request, body, state, tenant)
    llm = get_llm(state)
    _check_model(body.model, llm)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = llm.encode(llm.chat_prompt(messages))
    params = _sampling_params(body, llm, len(prompt_ids), body.wanted_max_tokens())
    shape = ChatShape(llm.model_id)
    return await _respond(request, body, llm, prompt_ids, params, shape, tenant)


def _check_model(name: str, llm: LLMService) -> None:
    if name != llm.model_id:
        known = ", ".join([llm.model_id, RAG_MODEL])
        raise OpenAIError(f"unknown model {name!r}; this server has: {known}", 404, "model")


def _sampling_params(
    body: _GenerationRequest, llm: LLMService, num_prompt_tokens: int, max_tokens: int | None
) -> SamplingParams:
    try:
        fitted = llm.fit_max_tokens(num_prompt_tokens, max_tokens)
        return SamplingParams(
            max_tokens=fitted,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=list(body.stop or []),
            ignore_eos=body.ignore_eos,
        )
    except ServiceError as exc:
        raise OpenAIError(str(exc), exc.status_code, getattr(exc, "param", "max_tokens")) from exc
    except ValueError as exc:
        raise OpenAIError(str(exc)) from exc


async def _respond(
    request: Request,
    body: _GenerationRequest,
    llm: LLMService,
    prompt_ids: list[int],
    params: SamplingParams,
    shape: Shape,
    tenant: str,
) -> Any:
    # a raw prompt has no public part: all of it is cached under the tenant's own salt
    stream = llm.generate(prompt_ids, params, cache_scope=CacheScope(namespace=tenant))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_sse(stream, shape, include_usage))
    result = await collect_until_disconnect(request, stream)
    if result is None:  # the client went away; nobody reads a response
        return JSONResponse(error_body("client disconnected"), status_code=499)
    return shape.full(result)


async def _sse(
    stream: AsyncIterator[GenerationDelta | GenerationResult], shape: Shape, include_usage: bool
) -> AsyncIterator[str]:
    first = shape.start()
    if first is not None:
        yield data_event(first)
    async for item in stream:
        if isinstance(item, GenerationDelta):
            if item.text:
                yield data_event(shape.delta(item.text))
            continue
        yield data_event(shape.finish(item.finish_reason))
        if include_usage:
            yield data_event(shape.usage_chunk(item))
    yield DONE
