"""SQLAlchemy 2 ORM models: API keys, collections, documents, their chunks and the chunks'
sentences.

A chunk's primary key is also its FAISS vector id, so it must be a 64-bit integer everywhere.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# The tenant of requests without a key, while the service runs without authentication.
DEFAULT_TENANT = "default"

DocumentStatus = Literal["pending", "processing", "ready", "failed"]
DOCUMENT_STATUSES: tuple[str, ...] = ("pending", "processing", "ready", "failed")

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base whose metadata Alembic migrates."""


class ApiKey(Base):
    """One API key. Only its SHA-256 is stored; the key itself is shown once, at creation.

    Each key is a tenant: `tenant` (its name at creation) owns collections, and a new key made
    with the same name after a revoke takes that tenant's data over (key rotation).
    """

    __tablename__ = "api_keys"
    __table_args__ = (UniqueConstraint("key_hash", name="uq_api_keys_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    key_prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Collection(Base):
    """A named group of one tenant's documents; searches can be limited to one."""

    __tablename__ = "collections"
    __table_args__ = (UniqueConstraint("tenant", "name", name="uq_collections_tenant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(200), server_default=DEFAULT_TENANT)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Document(Base):
    """One uploaded document; `status` moves pending -> processing -> ready | failed."""

    __tablename__ = "documents"
    __table_args__ = (UniqueConstraint("collection_id", "sha256", name="uq_documents_content"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    collection_id: Mapped[int] = mapped_column(
        ForeignKey("collections.id", ondelete="RESTRICT"), index=True
    )
    title: Mapped[str] = mapped_column(String(500))
    filename: Mapped[str | None] = mapped_column(String(500))
    media_type: Mapped[str] = mapped_column(String(100))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(20), index=True, default="pending")
    error: Mapped[str | None] = mapped_column(Text)
    # `metadata` is reserved by the declarative base, hence the attribute name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    collection: Mapped[Collection] = relationship(lazy="joined")


class Chunk(Base):
    """A span of a document's extracted text; its id is the FAISS vector id."""

    __tablename__ = "chunks"
    # AUTOINCREMENT: SQLite would otherwise reuse the ids (= vector ids) of deleted chunks
    __table_args__ = (
        UniqueConstraint("document_id", "ordinal", name="uq_chunks_ordinal"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    document_id: Mapped[int] = mapped_column(
        ForeignKey("documents.id", ondelete="CASCADE"), index=True
    )
    ordinal: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    char_start: Mapped[int] = mapped_column(Integer)
    char_end: Mapped[int] = mapped_column(Integer)
    page: Mapped[int | None] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    heading: Mapped[str | None] = mapped_column(Text)

    # Loaded on purpose (joinedload) where a chunk's title is needed, never lazily.
    document: Mapped[Document] = relationship(lazy="raise", viewonly=True)


class ChunkSentences(Base):
    """A chunk's sentences for evidence spans, embedded at ingest (retrieval.evidence's
    StoredSentences): derived data, kept so a restarted service answers its first questions
    without embedding every cited chunk's sentences again. `key` says which text, embedder and
    splitting they were made with; a row that no longer matches is ignored."""

    __tablename__ = "chunk_sentences"

    chunk_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("chunks.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[bytes] = mapped_column(LargeBinary(16))
    spans: Mapped[bytes] = mapped_column(LargeBinary)  # int32 little-endian [n, 2]
    vectors: Mapped[bytes] = mapped_column(LargeBinary)  # float16 little-endian [n, dim]
