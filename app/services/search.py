"""Search: resolve filters to the allowed chunk ids (a cached bitmap per tenant and collection,
see scopes.py), retrieve inside FAISS (and BM25 inside the database, filtered in its SQL), and
load the hits' chunk rows (text, offsets, document title) in one read."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services.lexical import ChunkScope
from prefixrag.app.services.scopes import ScopeCache
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.pipeline import RetrievalResult, Retriever


def allowed_chunk_ids(
    session: Session,
    *,
    scopes: ScopeCache,
    collection: str | None,
    document_ids: list[int] | None,
    tenant: str | None = None,
) -> IdBitmap | np.ndarray | None:
    """The ready chunks of `tenant` that pass the filters, or None when nothing needs filtering
    (no filter, and no other tenant has collections).

    A tenant or collection scope is a cached bitmap (no ids are loaded per query); a document
    filter reads only those documents' chunk ids.
    """
    scoped = tenant is not None and _has_other_tenants(session, tenant)
    if document_ids is not None:
        return _document_chunk_ids(session, tenant, collection, document_ids)
    if tenant is None:
        if collection is None:
            return None
        # no tenant (the CLI's all-tenants view): every tenant's collection of that name
        return _document_chunk_ids(session, None, collection, None)
    if collection is None and not scoped:
        return None
    return scopes.allowed(session, tenant=tenant, collection=collection)


def _document_chunk_ids(
    session: Session, tenant: str | None, collection: str | None, document_ids: list[int] | None
) -> np.ndarray:
    query = select(Chunk.id).join(Document).join(Collection).where(Document.status == "ready")
    if tenant is not None:
        query = query.where(Collection.tenant == tenant)
    if collection is not None:
        query = query.where(Collection.name == collection)
    if document_ids is not None:
        query = query.where(Document.id.in_(document_ids))
    return np.fromiter(session.scalars(query), dtype=np.int64)


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
    scopes: ScopeCache,
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
        session, scopes=scopes, collection=collection, document_ids=document_ids, tenant=tenant
    )
    if allowed is not None and _is_empty(allowed):
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


def _is_empty(allowed: IdBitmap | np.ndarray) -> bool:
    return allowed.is_empty if isinstance(allowed, IdBitmap) else len(allowed) == 0
