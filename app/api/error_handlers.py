"""How errors become HTTP answers: `{"detail": ...}` with the error's status on our routes, and
OpenAI's `{"error": {...}}` envelope on the OpenAI routes."""

from __future__ import annotations

import logging

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prefixrag.app.core.errors import (
    AuthenticationError,
    DuplicateDocumentError,
    OpenAIError,
    QueueFullError,
    ReplicaUnavailableError,
    ServiceError,
)
from prefixrag.app.schemas.openai import OPENAI_PATHS, error_body

logger = logging.getLogger(__name__)
DATABASE_UNAVAILABLE = "database unavailable"


def install_error_handlers(app: FastAPI) -> None:
    """Report ServiceError as JSON with its status; report OpenAIError, and validation and HTTP
    errors on the OpenAI paths, in OpenAI's envelope."""
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

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    # The database went away (stopped, restarting, unreachable): 503 with a reason, not a 500.
    # The pool reconnects by itself once it is back, so the app needs no restart.
    app.add_exception_handler(sqlalchemy.exc.OperationalError, database_unavailable)
    app.add_exception_handler(sqlalchemy.exc.TimeoutError, database_unavailable)


async def service_error(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 400)
    headers: dict[str, str] = {}
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, QueueFullError | ReplicaUnavailableError):
        headers["Retry-After"] = str(exc.retry_after)
    if request.url.path in OPENAI_PATHS:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse(error_body(str(exc), type_=kind), status, headers=headers)
    body: dict[str, object] = {"detail": str(exc)}
    if isinstance(exc, DuplicateDocumentError):
        body["document_id"] = exc.document_id
    return JSONResponse(body, status_code=status, headers=headers)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    logger.warning("database unavailable on %s: %s", request.url.path, exc.__class__.__name__)
    headers = {"Retry-After": "5"}
    if request.url.path in OPENAI_PATHS:
        body = error_body(DATABASE_UNAVAILABLE, type_="server_error")
        return JSONResponse(body, status_code=503, headers=headers)
    return JSONResponse({"detail": DATABASE_UNAVAILABLE}, status_code=503, headers=headers)
