"""Request and response bodies of POST /v1/query (the Q&A pipeline)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.schemas import COLLECTION_PATTERN


class QueryIn(BaseModel):
    """A question over the ready documents, optionally limited to a collection or documents.

    The question length and max_tokens are also checked against the settings
    (max_question_chars, max_tokens_cap) by the service, since those are configurable.
    """

    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    collection: str | None = Field(None, pattern=COLLECTION_PATTERN)
    document_ids: list[int] | None = Field(None, max_length=10_000)
    top_k: int | None = Field(None, ge=1, le=100)
    candidates: int | None = Field(None, ge=1, le=1000)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("question is empty (only whitespace)")
        return v


class CitationOut(BaseModel):
    """A source the answer may cite as [n]."""

    n: int
    document_id: int
    chunk_id: int
    title: str
    text: str
    start: int
    end: int
    page: int | None
    score: float


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class QueryOut(BaseModel):
    """The answer, its sources, token usage, stage timings and how many sources did not fit."""

    answer: str
    citations: list[CitationOut]
    usage: UsageOut
    timings: dict[str, float]
    dropped_chunks: int
    finish_reason: str
