"""Read a POST /v1/documents body (multipart file or JSON text) into an IngestRequest.

The body's size is bounded before this reads it (api/body_limits.py), and the document's own
size is checked where every document enters, in the ingest service."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from prefixrag.app.core.errors import InvalidInputError, UnsupportedTypeError
from prefixrag.app.schemas.documents import DocumentTextIn
from prefixrag.app.services.ingest import IngestRequest

MAX_FIELD_BYTES = 256 * 1024


async def read_ingest_request(request: Request) -> IngestRequest:
    """Parse the upload; raises UnsupportedTypeError or InvalidInputError."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/form-data"):
        return await _from_multipart(request.headers, request.stream())
    if content_type.startswith("application/json"):
        return await _from_json(request.stream())
    raise UnsupportedTypeError(
        f"request body type {content_type or 'missing'!r}: send multipart/form-data with a "
        "'file' field, or application/json with a 'text' field"
    )


async def _from_multipart(headers: Headers, stream: AsyncGenerator[bytes, None]) -> IngestRequest:
    parser = MultiPartParser(
        headers, stream, max_files=1, max_fields=16, max_part_size=MAX_FIELD_BYTES
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidInputError(f"malformed multipart body: {exc.message}") from exc
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidInputError("the multipart body needs a 'file' field holding the document")
        data = await upload.read()
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        return IngestRequest(
            data=data,
            filename=upload.filename,
            declared_type=upload.content_type,
            title=fields.get("title") or None,
            collection=fields.get("collection") or "default",
            metadata=_metadata(fields.get("metadata")),
        )
    finally:
        await form.close()


def _metadata(raw: str | None) -> dict[str, Any]:
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"metadata is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInputError(f"metadata must be a JSON object, not {type(value).__name__}")
    return value


async def _from_json(stream: AsyncIterator[bytes]) -> IngestRequest:
    body = b"".join([part async for part in stream])
    try:
        payload = DocumentTextIn.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidInputError(_validation_message(exc)) from exc
    return IngestRequest(
        data=payload.text.encode("utf-8"),
        declared_type=payload.media_type,
        title=payload.title,
        collection=payload.collection,
        metadata=payload.metadata,
    )


def _validation_message(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "body"
        message = error["msg"]
        if where == "metadata" and error["type"] == "dict_type":
            message = "metadata must be a JSON object"
        problems.append(f"{where}: {message}")
    return "invalid JSON body: " + "; ".join(problems)
