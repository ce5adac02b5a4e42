"""Search: resolve filters to chunk ids in the DB, retrieve inside FAISS (and BM25 inside the
database, filtered in its SQL), and load the hits' chunk rows (text, offsets, document title) in
one read."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services.lexical import ChunkScope
from prefixrag.retrieval.pipeline import RetrievalResult, Retriever


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


def load_ready_chunks(session: Session, chunk_ids: list[int]) -> dict[int, Chunk]:
    """The ready chunks among `chunk_ids`, each with its document loaded (for the title); ids
    that no longer exist, or whose document is not ready, are left out."""
    ids = [int(i) for i in chunk_ids]  # numpy ints do not bind as SQL parameters everywhere
    if not ids:
        return {}
    query = (
        select(Chunk)
        .join(Document)
        .options(contains_eager(Chunk.document))
        .where(Chunk.id.in_(ids), Document.status == "ready")
    )
    return {chunk.id: chunk for chunk in session.scalars(query)}


def search(
    *,
    session: Session,
    retriever: Retriever,
    query: str,
    top_k: int,
    candidates: int,
    tenant: str | None,
    collection: str | None = None,
    document_ids: list[int] | None = None,
) -> RetrievalResult[Chunk]:
    """The `top_k` best chunks for `query` among those of `tenant` (every tenant's when None)
    that the filters allow, each hit carrying its chunk row (text and document loaded).

    `candidates` is raised to `top_k` when smaller, since the reranker keeps top_k of them.
    """
    allowed = allowed_chunk_ids(
        session, collection=collection, document_ids=document_ids, tenant=tenant
    )
    if allowed is not None and allowed.size == 0:
        return RetrievalResult([], {"embed_ms": 0.0, "search_ms": 0.0, "rerank_ms": 0.0})
    return retriever.retrieve(
        query,
        top_k=top_k,
        candidates=max(candidates, top_k),
        allowed_ids=allowed,
        load_passages=lambda ids: load_ready_chunks(session, ids),
        # the same filters, applied inside the lexical store's SQL
        lexical_scope=ChunkScope(tenant, collection, document_ids),
    )
