"""Read a POST /v1/documents body (multipart file or JSON text) into an IngestRequest,
refusing oversized bodies early (Content-Length) and while streaming (byte count)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from prefixrag.app.core.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedTypeError,
)
from prefixrag.app.schemas.documents import DocumentTextIn
from prefixrag.app.services.ingest import IngestRequest

# Room for the multipart boundaries and the small form fields next to the file.
MULTIPART_OVERHEAD_BYTES = 1 << 20
MAX_FIELD_BYTES = 256 * 1024


async def read_ingest_request(request: Request, max_upload_bytes: int) -> IngestRequest:
    """Parse the upload; raises PayloadTooLargeError, UnsupportedTypeError or InvalidInputError."""
    body_limit = max_upload_bytes + MULTIPART_OVERHEAD_BYTES
    _check_content_length(request.headers, body_limit)
    content_type = request.headers.get("content-type", "").lower()
    stream = _limited(request.stream(), body_limit)
    if content_type.startswith("multipart/form-data"):
        return await _from_multipart(request.headers, stream, max_upload_bytes)
    if content_type.startswith("application/json"):
        return await _from_json(stream)
    raise UnsupportedTypeError(
        f"request body type {content_type or 'missing'!r}: send multipart/form-data with a "
        "'file' field, or application/json with a 'text' field"
    )


def _check_content_length(headers: Headers, body_limit: int) -> None:
    declared = headers.get("content-length")
    if declared is None:
        return
    try:
        num_bytes = int(declared)
    except ValueError:
        raise InvalidInputError(f"invalid Content-Length header {declared!r}") from None
    if num_bytes > body_limit:
        raise PayloadTooLargeError(f"request body is {num_bytes} bytes; the limit is {body_limit}")


async def _limited(stream: AsyncIterator[bytes], body_limit: int) -> AsyncGenerator[bytes, None]:
    # Content-Length can be absent (chunked) or wrong, so count what actually arrives.
    num_bytes = 0
    async for part in stream:
        num_bytes += len(part)
        if num_bytes > body_limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {body_limit} bytes")
        yield part


async def _from_multipart(
    headers: Headers, stream: AsyncGenerator[bytes, None], max_upload_bytes: int
) -> IngestRequest:
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
        data = await upload.read(max_upload_bytes + 1)
        if len(data) > max_upload_bytes:
            raise PayloadTooLargeError(
                f"file {upload.filename!r} exceeds the limit of {max_upload_bytes} bytes"
            )
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
