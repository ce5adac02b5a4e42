"""Search: resolve filters to chunk ids in the DB, retrieve inside FAISS, attach chunk details."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.schemas.search import SearchHitOut, SearchIn, SearchOut

if TYPE_CHECKING:
    from prefixrag.retrieval.pipeline import Retriever


def allowed_chunk_ids(
    session: Session,
    *,
    collection: str | None,
    document_ids: list[int] | None,
    tenant: str | None = None,
) -> np.ndarray | None:
    """Ids of the ready chunks of `tenant` that pass the filters, or None when nothing needs
    filtering (no filter, and no other tenant has collections)."""
    scoped = tenant is not None and _has_other_tenants(session, tenant)
    if collection is None and document_ids is None and not scoped:
        return None
    query = select(Chunk.id).join(Document).join(Collection).where(Document.status == "ready")
    if tenant is not None:
        query = query.where(Collection.tenant == tenant)
    if collection is not None:
        query = query.where(Collection.name == collection)
    if document_ids is not None:
        query = query.where(Document.id.in_(document_ids))
    return np.asarray(list(session.scalars(query)), dtype=np.int64)


def _has_other_tenants(session: Session, tenant: str) -> bool:
    other = select(Collection.id).where(Collection.tenant != tenant).limit(1)
    return session.scalar(other) is not None


def fetch_chunk_texts(sessions: sessionmaker[Session], chunk_ids: list[int]) -> dict[int, str]:
    """Texts of the given chunks by id; ids that no longer exist are left out."""
    ids = [int(i) for i in chunk_ids]  # numpy ints do not bind as SQL parameters everywhere
    if not ids:
        return {}
    with sessions() as session:
        rows = session.execute(select(Chunk.id, Chunk.text).where(Chunk.id.in_(ids)))
        return {chunk_id: text for chunk_id, text in rows}


def search(
    sessions: sessionmaker[Session],
    retriever: Retriever,
    request: SearchIn,
    tenant: str | None = None,
) -> SearchOut:
    """The `top_k` best chunks for `request.query` among those of `tenant` (every tenant's when
    None) that the filters allow.

    `candidates` is raised to `top_k` when smaller, since the reranker keeps top_k of them.
    """
    with sessions() as session:
        allowed = allowed_chunk_ids(
            session,
            collection=request.collection,
            document_ids=request.document_ids,
            tenant=tenant,
        )
    if allowed is not None and allowed.size == 0:
        return SearchOut(results=[], timings={"embed_ms": 0.0, "search_ms": 0.0, "rerank_ms": 0.0})
    result = retriever.retrieve(
        request.query,
        top_k=request.top_k,
        candidates=max(request.candidates, request.top_k),
        allowed_ids=allowed,
        fetch_texts=lambda ids: fetch_chunk_texts(sessions, ids),
    )
    details = _chunk_details(sessions, [int(hit.chunk_id) for hit in result.hits])
    results = []
    for hit in result.hits:
        found = details.get(int(hit.chunk_id))
        if found is None:  # deleted between the search and this lookup
            continue
        chunk, title = found
        results.append(
            SearchHitOut(
                chunk_id=chunk.id,
                document_id=chunk.document_id,
                title=title,
                text=chunk.text,
                score=float(hit.score),
                rerank_score=None if hit.rerank_score is None else float(hit.rerank_score),
                start=chunk.char_start,
                end=chunk.char_end,
                page=chunk.page,
                heading=chunk.heading,
            )
        )
    return SearchOut(results=results, timings=dict(result.timings))


def _chunk_details(
    sessions: sessionmaker[Session], chunk_ids: list[int]
) -> dict[int, tuple[Chunk, str]]:
    if not chunk_ids:
        return {}
    with sessions() as session:
        query = (
            select(Chunk, Document.title)
            .join(Document)
            .where(Chunk.id.in_(chunk_ids), Document.status == "ready")
        )
        return {chunk.id: (chunk, title) for chunk, title in session.execute(query)}
