"""The FastAPI application factory, the one place that assembles the layers. Serve with
`prefixrag serve` (uvicorn, factory mode)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI

from prefixrag.app.api.body_limits import install_body_limit
from prefixrag.app.api.deps import get_tenant
from prefixrag.app.api.error_handlers import install_error_handlers
from prefixrag.app.api.main import PUBLIC_ROUTERS, ROUTERS
from prefixrag.app.api.metrics_middleware import install_metrics
from prefixrag.app.core.settings import Settings, get_settings
from prefixrag.app.startup import default_loaders
from prefixrag.app.state import AppState, ComponentLoader

if TYPE_CHECKING:
    from prefixrag.retrieval.embedder import Embedder
    from prefixrag.retrieval.reranker import Reranker


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
    settings = settings or get_settings()
    loaders = [*default_loaders(settings), *extra_loaders]
    state = AppState(settings, embedder=embedder, reranker=reranker, loaders=loaders)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="prefixrag", version="0.1.0", lifespan=lifespan)
    app.state.prefixrag = state
    install_error_handlers(app)
    install_metrics(app, state.metrics)
    install_body_limit(app, settings)
    for router in PUBLIC_ROUTERS:
        app.include_router(router)
    for router in (*ROUTERS, *extra_routers):
        app.include_router(router, dependencies=[Depends(get_tenant)])
    return app
