"""Request and response bodies of /v1/documents, kept apart from the ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixrag.app.schemas.fields import COLLECTION_PATTERN, DocumentText


class DocumentTextIn(BaseModel):
    """A document sent as JSON text instead of a file upload."""

    model_config = ConfigDict(extra="forbid")

    text: DocumentText
    title: str | None = Field(None, max_length=500)
    collection: str = Field("default", pattern=COLLECTION_PATTERN)
    metadata: dict[str, Any] = Field(default_factory=dict)
    media_type: str = "text/plain"


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
