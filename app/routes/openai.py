"""OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions (SSE or not)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixrag.app.auth import TenantDep
from prefixrag.app.deps import StateDep
from prefixrag.app.error_responses import (
    COMMON_CODES,
    event_stream_response,
    openai_error_responses,
)
from prefixrag.app.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    _GenerationRequest,
    error_body,
    make_usage,
)
from prefixrag.app.services.errors import ServiceError
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

# Paths whose errors use OpenAI's envelope instead of FastAPI's {"detail": ...}.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})


class OpenAIError(Exception):
    """An error to report in OpenAI's shape."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param


def get_llm(state: StateDep) -> LLMService:
    """The LLM service; OpenAI-style 503 until it has loaded."""
    llm = getattr(state, "llm", None)
    if llm is None or state.status("llm") != "ok":
        raise OpenAIError(f"the model is not ready ({state.status('llm')})", status_code=503)
    return llm


LLMDep = Annotated[LLMService, Depends(get_llm)]

# Another model name served by this router (the RAG pipeline), mapped to its chat handler.
ChatHandler = Callable[[Request, ChatCompletionRequest], Any]
EXTRA_CHAT_MODELS: dict[str, ChatHandler] = {}


@router.get("/models")
def list_models(state: StateDep) -> dict[str, Any]:
    llm = getattr(state, "llm", None)
    names = ([llm.model_id] if llm is not None else []) + sorted(EXTRA_CHAT_MODELS)
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
    shape = _CompletionShape(llm.model_id)
    return await _respond(request, body, llm, prompt_ids, params, shape, tenant)


@router.post("/chat/completions", responses=_GENERATION_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Any:
    if body.model in EXTRA_CHAT_MODELS:
        return await EXTRA_CHAT_MODELS[body.model](request, body)
    llm = get_llm(state)
    _check_model(body.model, llm)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = llm.encode(llm.chat_prompt(messages))
    params = _sampling_params(body, llm, len(prompt_ids), body.wanted_max_tokens())
    shape = ChatShape(llm.model_id)
    return await _respond(request, body, llm, prompt_ids, params, shape, tenant)


def _check_model(name: str, llm: LLMService) -> None:
    if name != llm.model_id:
        known = ", ".join([llm.model_id, *sorted(EXTRA_CHAT_MODELS)])
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
    shape: _Shape,
    tenant: str,
) -> Any:
    # a raw prompt has no public part: all of it is cached under the tenant's own salt
    stream = llm.generate(prompt_ids, params, cache_scope=CacheScope(namespace=tenant))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(stream, shape, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    result = await collect_until_disconnect(request, stream)
    if result is None:  # the client went away; nobody reads a response
        return JSONResponse(error_body("client disconnected"), status_code=499)
    return shape.full(result)


async def collect_until_disconnect(
    request: Request, stream: AsyncIterator[GenerationDelta | GenerationResult]
) -> GenerationResult | None:
    """Run a generation to its end, or abort it (freeing its KV blocks) if the client leaves."""
    import asyncio

    async def final() -> GenerationResult:
        result = None
        async for item in stream:
            if isinstance(item, GenerationResult):
                result = item
        if result is None:
            raise RuntimeError("generation ended without a result")
        return result

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gen_task = asyncio.ensure_future(final())
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


async def _sse(
    stream: AsyncIterator[GenerationDelta | GenerationResult], shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    first = shape.start()
    if first is not None:
        yield sse_event(first)
    async for item in stream:
        if isinstance(item, GenerationDelta):
            if item.text:
                yield sse_event(shape.delta(item.text))
            continue
        yield sse_event(shape.finish(item.finish_reason))
        if include_usage:
            yield sse_event(shape.usage_chunk(item))
    yield "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One unnamed server-sent event carrying a JSON payload (OpenAI's stream framing)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Shape:
    """How one endpoint shapes its full response and its stream chunks."""

    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model_id: str) -> None:
        self.model = model_id
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, result: GenerationResult) -> dict[str, Any]:
        body = self.envelope(self.object_full, [self.full_choice(result)])
        body["usage"] = _usage(result)
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = _usage(result)
        return body

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> dict[str, Any] | None:
        return None

    def delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        return {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def delta(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str) -> dict[str, Any]:
        choice = {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        return self.envelope(self.object_chunk, [choice])


class ChatShape(_Shape):
    """chat.completion bodies and chat.completion.chunk stream chunks for one response."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text}
        return {
            "index": 0,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def start(self) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self.envelope(self.object_chunk, [choice])

    def delta(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "finish_reason": reason}
        return self.envelope(self.object_chunk, [choice])


def _usage(result: GenerationResult) -> dict[str, Any]:
    usage = make_usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
    return usage.model_dump()


def install_error_handlers(app: Any) -> None:
    """Report OpenAIError, and validation and HTTP errors on the OpenAI paths, in OpenAI's
    envelope."""
    from fastapi.exception_handlers import (
        http_exception_handler,
        request_validation_exception_handler,
    )
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException
    from starlette.responses import Response

    async def openai_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)  # registered for this class only
        return JSONResponse(error_body(str(exc), param=exc.param), status_code=exc.status_code)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)  # registered for this class only
        if request.url.path not in OPENAI_PATHS:
            return await request_validation_exception_handler(request, exc)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in exc.errors()
        )
        return JSONResponse(error_body(message or "invalid request", param=where), 422)

    async def http_error(request: Request, exc: Exception) -> Response:
        # FastAPI's own 400 (unparseable body) and the body limit's 413 raise HTTPException
        assert isinstance(exc, HTTPException)  # registered for this class only
        if request.url.path not in OPENAI_PATHS:
            return await http_exception_handler(request, exc)
        body = error_body(str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
