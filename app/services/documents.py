"""Read-only views of documents (writes belong to the ingest service)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from prefixrag.app.core.errors import DocumentNotFoundError
from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.schemas.documents import DocumentOut, DocumentPage


def get_document(*, session: Session, document_id: int, tenant: str | None = None) -> DocumentOut:
    """The document with `document_id` (of `tenant`, when given), or DocumentNotFoundError."""
    query = _with_counts().where(Document.id == document_id)
    if tenant is not None:
        query = query.join(Collection).where(Collection.tenant == tenant)
    row = session.execute(query).first()
    if row is None:
        raise DocumentNotFoundError(document_id)
    return _view(row[0], row[1])


def list_documents(
    *,
    session: Session,
    tenant: str | None = None,
    collection: str | None = None,
    limit: int = 20,
    offset: int = 0,
) -> DocumentPage:
    """One page of documents in id order, of `tenant` (all tenants when None), optionally only
    those of `collection`."""
    if limit < 1 or offset < 0:
        raise ValueError("limit must be positive and offset non-negative")
    query = _with_counts().join(Collection)
    total_query = select(func.count(Document.id)).join(Collection)
    if tenant is not None:
        query = query.where(Collection.tenant == tenant)
        total_query = total_query.where(Collection.tenant == tenant)
    if collection is not None:
        query = query.where(Collection.name == collection)
        total_query = total_query.where(Collection.name == collection)
    rows = session.execute(query.order_by(Document.id).limit(limit).offset(offset)).all()
    total = session.scalar(total_query) or 0
    items = [_view(doc, num_chunks) for doc, num_chunks in rows]
    return DocumentPage(items=items, total=total, limit=limit, offset=offset)


def _with_counts() -> Select[Document, int]:
    counts = (
        select(Chunk.document_id, func.count(Chunk.id).label("n"))
        .group_by(Chunk.document_id)
        .subquery()
    )
    num_chunks = func.coalesce(counts.c.n, 0)
    return select(Document, num_chunks).outerjoin(counts, counts.c.document_id == Document.id)


def _view(doc: Document, num_chunks: int) -> DocumentOut:
    return DocumentOut(
        id=doc.id,
        collection=doc.collection.name,
        title=doc.title,
        filename=doc.filename,
        media_type=doc.media_type,
        num_bytes=doc.num_bytes,
        sha256=doc.sha256,
        status=doc.status,
        error=doc.error,
        metadata=doc.meta or {},
        num_chunks=num_chunks,
        created_at=_utc(doc.created_at),
        updated_at=_utc(doc.updated_at),
    )


def _utc(moment: datetime) -> datetime:
    # SQLite drops the timezone on the way back; every stored time is UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
