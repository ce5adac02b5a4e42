"""Request and response bodies of /v1/search."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from prefixrag.app.schemas.fields import RowId, SearchQuery


class SearchIn(BaseModel):
    """A search over the ready documents, optionally limited to a collection or document ids."""

    model_config = ConfigDict(extra="forbid")

    query: SearchQuery
    top_k: int = Field(5, ge=1, le=100)
    candidates: int = Field(50, ge=1, le=1000)
    collection: str | None = None
    document_ids: list[RowId] | None = Field(None, max_length=10_000)


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
