"""Semantic search over the ready chunks."""

from __future__ import annotations

from fastapi import APIRouter

from prefixrag.app.api.auth import TenantDep
from prefixrag.app.api.deps import RetrieverDep, StateDep
from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.schemas.errors import COMMON_CODES, error_responses
from prefixrag.app.schemas.search import SearchIn, SearchOut
from prefixrag.app.services.search import search

router = APIRouter(prefix="/v1", tags=["search"], responses=error_responses(*COMMON_CODES))


@router.post("/search", response_model=SearchOut)
def search_chunks(
    body: SearchIn, state: StateDep, retriever: RetrieverDep, tenant: TenantDep
) -> SearchOut:
    """The best `top_k` chunks for the query, filtered inside the index search."""
    if state.sessions is None:
        raise NotReadyError("database is not ready")
    return search(state.sessions, retriever, body, tenant)
