"""Semantic search over the ready chunks."""

from __future__ import annotations

from fastapi import APIRouter

from prefixrag.app.auth import TenantDep
from prefixrag.app.deps import RetrieverDep, StateDep
from prefixrag.app.error_responses import COMMON_CODES, error_responses
from prefixrag.app.schemas import SearchIn, SearchOut
from prefixrag.app.services.errors import NotReadyError
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
