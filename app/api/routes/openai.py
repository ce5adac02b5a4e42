"""OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions (SSE or not).

The chat route also serves the `prefixrag-rag` model, answered by the Q&A pipeline
(routes/rag_chat.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prefixrag.app.api.choices import Item, collect_choices, fan_out
from prefixrag.app.api.deps import LLMDep, StateDep, TenantDep, get_llm
from prefixrag.app.api.openai_shapes import ChatShape, CompletionShape, Shape
from prefixrag.app.api.rag_chat import RAG_MODEL, rag_chat_completion
from prefixrag.app.api.sse import DONE, data_event, event_stream, until_disconnect
from prefixrag.app.core.errors import OpenAIError, ServiceError
from prefixrag.app.schemas.errors import COMMON_CODES, event_stream_response, openai_error_responses
from prefixrag.app.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    _GenerationRequest,
    error_body,
)
from prefixrag.app.schemas.sampling import out_of_vocabulary
from prefixrag.app.services.llm import LLMService
from prefixrag.app.services.scopes import Scope
from prefixrag.engine.outputs import GenerationDelta
from prefixrag.engine.sampling.params import SamplingParams

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
    shape = CompletionShape(llm.model_id, llm.token_text)
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
    shape = ChatShape(llm.model_id, llm.token_text)
    return await _respond(request, body, llm, prompt_ids, params, shape, tenant)


def _check_model(name: str, llm: LLMService) -> None:
    if name != llm.model_id:
        known = ", ".join([llm.model_id, RAG_MODEL])
        raise OpenAIError(f"unknown model {name!r}; this server has: {known}", 404, "model")


def _sampling_params(
    body: _GenerationRequest, llm: LLMService, num_prompt_tokens: int, max_tokens: int | None
) -> SamplingParams:
    bad_bias = out_of_vocabulary(body.logit_bias, llm.vocab_size)
    if bad_bias is not None:  # a range error like the others the schema reports: 422
        raise OpenAIError(bad_bias, 422, "logit_bias")
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
            logprobs=body.num_logprobs(),
            **body.sampling_kwargs(),
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
    scope = Scope(tenant).cache_scope(stable_ids=())
    streams = [
        llm.generate(prompt_ids, choice_params, cache_scope=scope)
        for choice_params in _per_choice(params, body.n)
    ]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_sse(fan_out(streams), body.n, shape, include_usage))
    results = await until_disconnect(request, collect_choices(streams))
    if results is None:  # the client went away; nobody reads a response
        return JSONResponse(error_body("client disconnected"), status_code=499)
    return shape.full_n(results)


def _per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    # A seeded request stays reproducible, yet its choices differ: choice i draws from seed + i.
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


async def _sse(
    stream: AsyncIterator[tuple[int, Item]], n: int, shape: Shape, include_usage: bool
) -> AsyncIterator[str]:
    for index in range(n):
        first = shape.start(index)
        if first is not None:
            yield data_event(first)
    results = []
    async for index, item in stream:
        if isinstance(item, GenerationDelta):
            if item.text or item.logprobs:  # a token whose text is pending still has logprobs
                yield data_event(shape.delta(item.text, index, item.logprobs))
            continue
        results.append(item)
        yield data_event(shape.finish(item.finish_reason, index))
    if include_usage and results:
        yield data_event(shape.usage_chunk(*results))
    yield DONE
