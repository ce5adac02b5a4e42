"""Semantic search over the ready chunks."""

from __future__ import annotations

from fastapi import APIRouter

from prefixrag.app.api.deps import RetrieverDep, ScopesDep, SessionDep, TenantDep
from prefixrag.app.schemas.errors import COMMON_CODES, error_responses
from prefixrag.app.schemas.search import SearchHitOut, SearchIn, SearchOut
from prefixrag.app.services.scopes import Scope
from prefixrag.app.services.search import search

router = APIRouter(prefix="/v1", tags=["search"], responses=error_responses(*COMMON_CODES))


@router.post("/search", response_model=SearchOut)
def search_chunks(
    body: SearchIn,
    session: SessionDep,
    retriever: RetrieverDep,
    scopes: ScopesDep,
    tenant: TenantDep,
) -> SearchOut:
    """The best `top_k` chunks for the query, filtered inside the index search."""
    found = search(
        session=session,
        retriever=retriever,
        scopes=scopes,
        query=body.query,
        top_k=body.top_k,
        candidates=body.candidates,
        scope=Scope(tenant, body.collection, body.document_ids),
    )
    results = [
        SearchHitOut(
            chunk_id=hit.chunk_id,
            document_id=hit.passage.document_id,
            title=hit.passage.document.title,
            text=hit.passage.text,
            score=hit.score,
            rerank_score=hit.rerank_score,
            start=hit.passage.char_start,
            end=hit.passage.char_end,
            page=hit.passage.page,
            heading=hit.passage.heading,
        )
        for hit in found.hits
    ]
    return SearchOut(results=results, timings=found.timings)
