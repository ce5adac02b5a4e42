"""Search: resolve the scope to the allowed chunk ids (a cached bitmap per tenant and collection,
see scopes.py), retrieve inside FAISS (and BM25 inside the database, filtered in its SQL), and
load the hits' chunk rows (text, offsets, document title) in one read."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager

from prefixrag.app.core.models import Chunk, Document
from prefixrag.app.services.scopes import Scope, ScopeCache
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.pipeline import RetrievalResult, Retriever


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
    scope: Scope,
) -> RetrievalResult[Chunk]:
    """The `top_k` best chunks for `query` among those `scope` allows, each hit carrying its
    chunk row (text and document loaded).

    `candidates` is raised to `top_k` when smaller, since the reranker keeps top_k of them.
    """
    allowed = scope.allowed_ids(session, scopes)
    if allowed is not None and _is_empty(allowed):
        return RetrievalResult([], {"embed_ms": 0.0, "search_ms": 0.0, "rerank_ms": 0.0})
    return retriever.retrieve(
        query,
        top_k=top_k,
        candidates=max(candidates, top_k),
        allowed_ids=allowed,
        load_passages=lambda ids: load_ready_chunks(session, ids),
        # the same scope, applied inside the lexical store's SQL (or tantivy's filter)
        lexical_scope=scope,
    )


def _is_empty(allowed: IdBitmap | np.ndarray) -> bool:
    return allowed.is_empty if isinstance(allowed, IdBitmap) else len(allowed) == 0
