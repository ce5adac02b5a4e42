"""The error answers each route documents in the OpenAPI schema, in the two shapes it sends:
`{"detail": ...}` on our own routes and OpenAI's `{"error": {...}}` on the OpenAI routes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

DESCRIPTIONS = {
    400: "malformed request (for example a body that is not JSON)",
    401: "an API key is required, or the one sent is invalid",
    404: "no such resource (or it belongs to another tenant)",
    409: "conflicts with the current state (a duplicate upload, a document being deleted)",
    413: "request body too large",
    415: "unsupported document type",
    422: "invalid parameters",
    429: "too many requests queued; retry after the Retry-After header's seconds",
    503: "a component is still loading or failed to load",
}
# What any route behind an API key can answer, whatever it does.
COMMON_CODES = (400, 401, 413, 422, 503)


class ErrorOut(BaseModel):
    """Our routes' error body: `detail` says what is wrong."""

    detail: str


class InvalidInputOut(BaseModel):
    """A 422 body: FastAPI's list of validation errors, or a service's one-line reason."""

    detail: str | list[dict[str, Any]]


class OpenAIErrorDetail(BaseModel):
    """The inside of OpenAI's error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorOut(BaseModel):
    """OpenAI's error body: `error.message` says what is wrong."""

    error: OpenAIErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for `codes`, each answered with an ErrorOut body (422: with
    InvalidInputOut, as FastAPI's own 422 lists its validation errors)."""
    return {
        code: {
            "model": InvalidInputOut if code == 422 else ErrorOut,
            "description": DESCRIPTIONS[code],
        }
        for code in codes
    }


def openai_error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for `codes`, each answered with an OpenAIErrorOut body."""
    return {code: {"model": OpenAIErrorOut, "description": DESCRIPTIONS[code]} for code in codes}


def event_stream_response(description: str) -> dict[int | str, dict[str, Any]]:
    """Documents that a 200 may also be a `text/event-stream` (when the request streams)."""
    # one server-sent event; `data` is a JSON text (or OpenAI's final "[DONE]")
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    }
    content = {"text/event-stream": {"schema": event}}
    return {200: {"description": description, "content": content}}
