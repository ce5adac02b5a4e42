"""Every route of the API: the routers behind an API key, and the public ones."""

from __future__ import annotations

from fastapi import APIRouter

from prefixrag.app.api.routes import documents, health, metrics, openai, query, search, web

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
