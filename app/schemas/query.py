"""Request and response bodies of POST /v1/query (the Q&A pipeline)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixrag.app.schemas.fields import COLLECTION_PATTERN, EarlierQuestion, Question, RowId
from prefixrag.app.schemas.sampling import SamplingControls

MAX_HISTORY_TURNS = 32
# Questions and answers of a whole conversation together: far more than any context window
# holds, so it only stops abuse, never a real conversation.
MAX_CONVERSATION_CHARS = 200_000


class TurnIn(BaseModel):
    """An earlier turn as the client got it back: the question, the answer text exactly as
    returned, and the `chunk_ids` that turn's response listed."""

    model_config = ConfigDict(extra="forbid")

    question: EarlierQuestion
    answer: str
    chunk_ids: list[RowId] = Field(default_factory=list, max_length=100)


class QueryIn(SamplingControls):
    """A question over the ready documents, optionally limited to a collection or documents,
    optionally following earlier turns of the same conversation (`history`, oldest first).
    The answer is sampled with `temperature` and the shared controls (penalties, min_p,
    logit_bias; see schemas/sampling.py).

    The question length and max_tokens are also checked against the settings
    (max_question_chars, max_tokens_cap) by the service, since those are configurable.
    """

    model_config = ConfigDict(extra="forbid")

    question: Question
    collection: str | None = Field(None, pattern=COLLECTION_PATTERN)
    document_ids: list[RowId] | None = Field(None, max_length=10_000)
    top_k: int | None = Field(None, ge=1, le=100)
    candidates: int | None = Field(None, ge=1, le=1000)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False
    history: list[TurnIn] = Field(default_factory=list, max_length=MAX_HISTORY_TURNS)

    @model_validator(mode="after")
    def _conversation_limits(self) -> QueryIn:
        num_chars = len(self.question) + sum(len(t.question) + len(t.answer) for t in self.history)
        if num_chars > MAX_CONVERSATION_CHARS:
            raise ValueError(
                f"the conversation has {num_chars} characters of questions and answers; at most "
                f"{MAX_CONVERSATION_CHARS} are allowed (start a new conversation)"
            )
        chunk_ids = [i for t in self.history for i in t.chunk_ids]
        if len(chunk_ids) != len(set(chunk_ids)):
            raise ValueError("a chunk id appears in more than one earlier turn")
        return self


class EvidenceOut(BaseModel):
    """A sentence (or two) of the cited chunk that best answers the question: `text` is
    `chunk.text[start:end]`, and `document_start`/`document_end` are the same span in the
    document's text. `score` ranks the spans of one answer (higher is better)."""

    start: int
    end: int
    document_start: int
    document_end: int
    text: str
    score: float

    def one_line(self, limit: int = 300) -> str:
        """The span's text on one line (each run of whitespace as one space), cut to `limit`
        characters: how the CLI and the chat model's sources block quote it."""
        flat = " ".join(self.text.split())
        return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class CitationOut(BaseModel):
    """A source the answer may cite as [n], with its `evidence` spans, best first."""

    n: int
    document_id: int
    chunk_id: int
    title: str
    text: str
    start: int
    end: int
    page: int | None
    score: float
    evidence: list[EvidenceOut] = Field(default_factory=list)


class UsageOut(BaseModel):
    """Token counts. Of the prompt, `cached_tokens` came from an exact prefix hit,
    `blended_tokens` from cached source bodies placed at new positions (not computed again),
    and `recomputed_tokens` were cached bodies that blending computed again."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    blended_tokens: int = 0
    recomputed_tokens: int = 0


class SupportOut(BaseModel):
    """The best evidence span over every source: what the answer should rest on."""

    n: int
    title: str
    text: str
    score: float


class GroundingOut(BaseModel):
    """Whether the answer rests on its sources: `grounded` is false when it cites none of them,
    or says they lack the answer while a span scores high; `reason` says which. `cited` are the
    source numbers the answer names; `support` is the best evidence span (shown under an answer
    that is not grounded)."""

    grounded: bool
    reason: str | None = None
    cited: list[int] = Field(default_factory=list)
    support: SupportOut | None = None


class QueryOut(BaseModel):
    """The answer, its sources, token usage, stage timings and how many sources did not fit.

    `citations` are every source this answer may cite (sources of earlier turns keep their
    numbers); `chunk_ids` are the chunks this turn added to the conversation, which the client
    sends back in `history`. `dropped_turns` counts the oldest turns left out to fit.
    """

    answer: str
    citations: list[CitationOut]
    chunk_ids: list[int]
    usage: UsageOut
    timings: dict[str, float]
    dropped_chunks: int
    dropped_turns: int
    finish_reason: str
    grounding: GroundingOut
