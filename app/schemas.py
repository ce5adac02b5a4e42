"""Request and response bodies of the HTTP API, kept apart from the ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$"
# Row ids are 32-bit on PostgreSQL: a bigger one is refused here rather than by the database.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]


class DocumentTextIn(BaseModel):
    """A document sent as JSON text instead of a file upload."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    title: str | None = Field(None, max_length=500)
    collection: str = Field("default", pattern=COLLECTION_PATTERN)
    metadata: dict[str, Any] = Field(default_factory=dict)
    media_type: str = "text/plain"

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("text is empty (only whitespace)")
        return v


class DocumentAccepted(BaseModel):
    """The answer to an upload that is being ingested in the background."""

    document_id: int
    status: str


class DocumentOut(BaseModel):
    """A document's public view: what it is, its ingest status and how many chunks it has."""

    id: int
    collection: str
    title: str
    filename: str | None
    media_type: str
    num_bytes: int
    sha256: str
    status: str
    error: str | None
    metadata: dict[str, Any]
    num_chunks: int
    created_at: datetime
    updated_at: datetime


class DocumentPage(BaseModel):
    """One page of the document list."""

    items: list[DocumentOut]
    total: int
    limit: int
    offset: int


class SearchIn(BaseModel):
    """A search over the ready documents, optionally limited to a collection or document ids."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4000)
    top_k: int = Field(5, ge=1, le=100)
    candidates: int = Field(50, ge=1, le=1000)
    collection: str | None = None
    document_ids: list[RowId] | None = Field(None, max_length=10_000)

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("query is empty (only whitespace)")
        return v


class SearchHitOut(BaseModel):
    """One retrieved chunk with where it sits in its document."""

    chunk_id: int
    document_id: int
    title: str
    text: str
    score: float
    rerank_score: float | None
    start: int
    end: int
    page: int | None
    heading: str | None


class SearchOut(BaseModel):
    """Search results, best first, and how long each stage took."""

    results: list[SearchHitOut]
    timings: dict[str, float]
