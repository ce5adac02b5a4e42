"""The FastAPI application factory. Serve with `prefixrag serve` (uvicorn, factory mode)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from prefixrag.app.api.auth import get_tenant
from prefixrag.app.api.body_limits import install_body_limit
from prefixrag.app.api.routes import documents, health, metrics, openai, query, search, web
from prefixrag.app.api.routes.rag_chat import register_rag_model
from prefixrag.app.core.errors import (
    AuthenticationError,
    DuplicateDocumentError,
    QueueFullError,
    ServiceError,
)
from prefixrag.app.core.settings import Settings, get_settings
from prefixrag.app.schemas.openai import error_body
from prefixrag.app.services.metrics import install_metrics
from prefixrag.app.state import AppState, ComponentLoader

if TYPE_CHECKING:
    from prefixrag.retrieval.embedder import Embedder
    from prefixrag.retrieval.reranker import Reranker

logger = logging.getLogger(__name__)

# Routers every app serves behind an API key (when keys are on); a feature adds its own here.
ROUTERS: tuple[APIRouter, ...] = (
    documents.router,
    search.router,
    openai.router,
    query.router,
    metrics.router,
)
# Routers open to all: probes, and the page shell, which holds no data (its API calls need a key).
PUBLIC_ROUTERS: tuple[APIRouter, ...] = (health.router, web.router)


def create_app(
    settings: Settings | None = None,
    *,
    embedder: Embedder | None = None,
    reranker: Reranker | None = None,
    extra_loaders: Sequence[ComponentLoader] = (),
    extra_routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """An app whose lifespan loads components in the background and releases them at shutdown.

    `embedder`/`reranker` replace the configured models (tests share one); `extra_loaders`
    run after the default ones; the state is `app.state.prefixrag`.
    """
    state = AppState(settings or get_settings(), embedder=embedder, reranker=reranker)
    if state.settings.load_llm:
        from prefixrag.app.services.llm import load_llm
        from prefixrag.app.services.prompt_cache import load_prompt_cache

        state.add_loader(ComponentLoader("llm", load_llm))
        state.add_loader(ComponentLoader("prompt_cache", load_prompt_cache, required=False))
    for loader in extra_loaders:
        state.add_loader(loader)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="prefixrag", version="0.1.0", lifespan=lifespan)
    app.state.prefixrag = state
    app.add_exception_handler(ServiceError, _service_error)
    openai.install_error_handlers(app)
    install_metrics(app, state)
    install_body_limit(app, state.settings)
    register_rag_model()
    for router in PUBLIC_ROUTERS:
        app.include_router(router)
    for router in (*ROUTERS, *extra_routers):
        app.include_router(router, dependencies=[Depends(get_tenant)])
    return app


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 400)
    headers: dict[str, str] = {}
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(exc.retry_after)
    if request.url.path in openai.OPENAI_PATHS:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse(error_body(str(exc), type_=kind), status, headers=headers)
    body: dict[str, object] = {"detail": str(exc)}
    if isinstance(exc, DuplicateDocumentError):
        body["document_id"] = exc.document_id
    return JSONResponse(body, status_code=status, headers=headers)
