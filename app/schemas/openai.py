"""Request and response shapes of the OpenAI-compatible API (the parts we serve)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixrag.app.schemas.sampling import SamplingControls

# Paths whose errors use OpenAI's envelope instead of FastAPI's {"detail": ...}.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
# Choices per request: each is a sequence of its own in the engine's batch.
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """Only plain text: a JSON mode we do not enforce must not look accepted."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class _GenerationRequest(SamplingControls):
    # A field we do not serve is refused (422 naming it), never ignored: a client that sends
    # one believes it took effect. `user` and `metadata` change no output, and OpenAI clients
    # send them, so they are accepted and not used.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None

    def num_logprobs(self) -> int | None:
        """How many alternatives per token the engine reports; None for no logprobs."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings are allowed")
        return stops


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int]
    echo: Literal[False] = Field(False, description="echoing the prompt is not supported")
    logprobs: int | None = Field(None, ge=0, le=5)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):  # type: ignore[operator]
            raise ValueError("token ids must be >= 0")
        return v  # type: ignore[return-value]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    """OpenAI's cached_tokens (exact prefix hits), and beside it our chunk reuse: source bodies
    reused at new positions and those computed again by blending."""

    cached_tokens: int
    blended_tokens: int = 0
    recomputed_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    blended_tokens: int = 0,
    recomputed_tokens: int = 0,
) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached_tokens,
            blended_tokens=blended_tokens,
            recomputed_tokens=recomputed_tokens,
        ),
    )


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}
