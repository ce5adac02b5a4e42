"""The ask path: retrieve (through the search service), build the prompt, generate.

`prepare_answer` does everything up to the engine call and raises ServiceError on bad input;
the caller then streams `answer_stream(...)` and shapes the result with the helpers below, so
/v1/query and the `prefixrag-rag` chat model share one pipeline.

Conversations are stateless on the server: the client sends the earlier turns back (question,
answer text, the chunk ids each turn added), the chunk texts are read again from the DB, and the
prompt repeats every earlier turn exactly, so the engine's prefix cache serves all of it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from prefixrag.app.core.errors import HistoryChunkNotFoundError, InvalidInputError
from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.core.settings import Settings
from prefixrag.app.prompt.builder import BuiltPrompt, PromptBuilder, Source, Turn
from prefixrag.app.prompt.parts import ANSWER_STOP, NOT_IN_SOURCES
from prefixrag.app.schemas.query import CitationOut, EvidenceOut, QueryIn, TurnIn, UsageOut
from prefixrag.app.schemas.sampling import out_of_vocabulary
from prefixrag.app.services.llm import LLMService, document_tag
from prefixrag.app.services.scopes import Scope, ScopeCache
from prefixrag.app.services.search import search
from prefixrag.app.services.sentence_store import restore_sentences
from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.retrieval.evidence import EvidenceFinder, EvidenceSpan
from prefixrag.retrieval.pipeline import Hit, RetrievalResult, Retriever


@dataclass(slots=True, frozen=True)
class QAPipeline:
    """What answering a question needs, loaded: the database, the retriever, the LLM and the
    prompt builder, with the settings that bound a question (and where retrieval times go).
    `evidence` finds each citation's best sentences (None: citations carry no spans)."""

    sessions: sessionmaker[Session]
    retriever: Retriever
    scopes: ScopeCache
    llm: LLMService
    prompts: PromptBuilder
    settings: Settings
    on_retrieval: Callable[[dict[str, float]], None] | None = None
    evidence: EvidenceFinder | None = None


@dataclass(slots=True)
class PreparedAnswer:
    """A question retrieved and laid out, ready to generate."""

    prompt: BuiltPrompt
    params: SamplingParams
    retrieval_ms: dict[str, float]
    started: float  # time.perf_counter() when the request arrived
    scope: Scope  # what the request may see, and under whose salt its KV is cached
    evidence: dict[int, list[EvidenceSpan]]  # chunk id -> its best spans, best first


async def prepare_answer(*, pipeline: QAPipeline, query: QueryIn, tenant: str) -> PreparedAnswer:
    """Check limits, retrieve the top_k sources and build the prompt (dropping the lowest-ranked
    sources if it would not fit next to max_tokens). Raises ServiceError subclasses."""
    started = time.perf_counter()
    settings = pipeline.settings
    for i, question in enumerate([*(t.question for t in query.history), query.question]):
        if len(question) > settings.max_question_chars:
            where = "question" if i == len(query.history) else f"history[{i}].question"
            raise InvalidInputError(
                f"{where} has {len(question)} characters; at most "
                f"{settings.max_question_chars} are allowed"
            )
    llm = pipeline.llm
    max_tokens = llm.resolve_max_tokens(query.max_tokens, settings.answer_max_tokens)
    bad_bias = out_of_vocabulary(query.logit_bias, llm.vocab_size)
    if bad_bias is not None:
        raise InvalidInputError(bad_bias)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=query.temperature,
        stop=ANSWER_STOP,
        stop_after=[NOT_IN_SOURCES],
        **query.sampling_kwargs(no_repeat_ngram_size=settings.answer_no_repeat_ngram_size),
    )
    scope = Scope(tenant, query.collection, query.document_ids)
    history, found = await run_in_threadpool(_read, pipeline, query, scope)
    num_key_lines = settings.answer_key_lines if pipeline.evidence is not None else 0
    key_lines_s = 0.0
    if num_key_lines and history:
        t0 = time.perf_counter()
        history = await run_in_threadpool(_with_key_lines, pipeline, history, num_key_lines)
        key_lines_s = time.perf_counter() - t0
    hits, timings = found.hits, dict(found.timings)
    if pipeline.on_retrieval is not None:
        pipeline.on_retrieval(timings)
    room = llm.max_model_len - max_tokens
    ranked = [to_source(hit) for hit in hits]
    cache_scope = scope.cache_scope(pipeline.prompts.stable_ids)
    # Following the cached prefix is part of chunk reuse: with it off, today's prompts exactly.
    follow_cache = settings.chunk_reuse and settings.prefix_cache
    prompt = pipeline.prompts.build(
        query.question,
        ranked,
        max_prompt_tokens=room,
        history=history,
        cached_prefix_len=(
            (lambda ids: llm.cached_prefix_len(ids, cache_scope)) if follow_cache else None
        ),
    )
    evidence = await run_in_threadpool(
        _find_evidence, pipeline, query.question, found.query_vector, prompt, timings
    )
    if num_key_lines and prompt.sources:
        # Over this turn's new sources only, found as a follow-up finds them again (see
        # _with_key_lines): `evidence` is that very call when no earlier source is reused.
        mine, t0 = evidence, time.perf_counter()
        if prompt.reused:
            mine = await run_in_threadpool(
                _turn_evidence, pipeline, query.question, prompt.sources, found.query_vector
            )
        lines = key_lines(prompt.sources, mine, num_key_lines)
        prompt = pipeline.prompts.with_key_lines(
            prompt, query.question, lines, max_prompt_tokens=room
        )
        key_lines_s += time.perf_counter() - t0
    # choosing this turn's key lines, and finding earlier turns' again
    timings["key_lines_ms"] = key_lines_s * 1000.0
    return PreparedAnswer(prompt, params, timings, started, scope, evidence)


def key_lines(
    sources: Sequence[Source], evidence: dict[int, list[EvidenceSpan]], limit: int
) -> list[tuple[int, str]]:
    """The `limit` best evidence sentences of `sources`, as (chunk id, text), best first (scores
    compare within one question; ties keep the sources' order)."""
    scored = [
        (span.score, source.chunk_id, source.text[span.start : span.end])
        for source in sources
        for span in evidence.get(source.chunk_id, ())
    ]
    scored.sort(key=lambda item: -item[0])
    return [(chunk_id, text) for _, chunk_id, text in scored[:limit]]


def _with_key_lines(pipeline: QAPipeline, history: list[Turn], limit: int) -> list[Turn]:
    """The earlier turns with the key lines their own prompts had, found again the same way (the
    same question over the same chunks in the same order), so a follow-up's prompt still extends
    them token for token and the prefix cache serves them."""
    keyed = []
    for turn in history:
        evidence = _turn_evidence(pipeline, turn.question, turn.sources, None)
        keyed.append(replace(turn, key_lines=tuple(key_lines(turn.sources, evidence, limit))))
    return keyed


def _turn_evidence(
    pipeline: QAPipeline,
    question: str,
    sources: Sequence[Source],
    question_vector: np.ndarray | None,
) -> dict[int, list[EvidenceSpan]]:
    finder, retriever = pipeline.evidence, pipeline.retriever
    if finder is None or not sources:
        return {}
    texts = [s.text for s in sources]
    chunk_ids = [s.chunk_id for s in sources]
    restore_sentences(pipeline.sessions, finder, retriever.embedder, chunk_ids, texts)
    found = finder.find(
        question,
        texts,
        embedder=retriever.embedder,
        reranker=retriever.reranker if retriever.is_reranking else None,
        question_vector=question_vector,
    )
    return {s.chunk_id: spans for s, spans in zip(sources, found, strict=True)}


def _find_evidence(
    pipeline: QAPipeline,
    question: str,
    question_vector: np.ndarray | None,
    prompt: BuiltPrompt,
    timings: dict[str, float],
) -> dict[int, list[EvidenceSpan]]:
    """Each citable source's best spans for this question (earlier turns' sources too: the
    answer may rest on them), timed into `timings["evidence_ms"]`. `question_vector` is
    retrieval's embedding of the question, when it made one."""
    sources = [source for _, source in prompt.numbered]
    if pipeline.evidence is None or not sources:
        return {}
    t0 = time.perf_counter()
    found = _turn_evidence(pipeline, question, sources, question_vector)
    timings["evidence_ms"] = (time.perf_counter() - t0) * 1000.0
    return found


def _read(
    pipeline: QAPipeline, query: QueryIn, scope: Scope
) -> tuple[list[Turn], RetrievalResult[Chunk]]:
    # One session for everything this question reads: earlier turns, then retrieval.
    with pipeline.sessions() as session:
        history = history_turns(session=session, query=query, tenant=scope.tenant or "")
        found = _retrieve(
            session=session, pipeline=pipeline, question=query.question, query=query, scope=scope
        )
    return history, found


def history_turns(*, session: Session, query: QueryIn, tenant: str) -> list[Turn]:
    """The earlier turns with their chunks read again from the DB, in the order each turn
    listed them. Raises HistoryChunkNotFoundError (404) for a chunk that is gone or another
    tenant's, and InvalidInputError (422) for one outside the query's collection or documents."""
    if not query.history:
        return []
    wanted = [i for turn in query.history for i in turn.chunk_ids]
    rows = session.execute(
        select(Chunk, Document.title, Document.status, Collection.name)
        .join(Document, Chunk.document_id == Document.id)
        .join(Collection, Document.collection_id == Collection.id)
        .where(Chunk.id.in_(wanted), Collection.tenant == tenant)
    ).all()
    found = {chunk.id: (chunk, title, status, name) for chunk, title, status, name in rows}
    return [_turn(i, turn, found, query) for i, turn in enumerate(query.history)]


def _turn(
    i: int, turn: TurnIn, found: dict[int, tuple[Chunk, str, str, str]], query: QueryIn
) -> Turn:
    sources = []
    for chunk_id in turn.chunk_ids:
        if chunk_id not in found or found[chunk_id][2] != "ready":
            raise HistoryChunkNotFoundError(
                f"history[{i}] cites chunk {chunk_id}, which no longer exists (its document was "
                "deleted); start a new conversation"
            )
        chunk, title, _, collection = found[chunk_id]
        if query.collection is not None and collection != query.collection:
            raise InvalidInputError(
                f"history[{i}] cites chunk {chunk_id} of collection {collection!r}, not of "
                f"{query.collection!r}"
            )
        if query.document_ids is not None and chunk.document_id not in query.document_ids:
            raise InvalidInputError(
                f"history[{i}] cites chunk {chunk_id} of document {chunk.document_id}, which "
                "document_ids leaves out"
            )
        sources.append(_chunk_source(chunk, title))
    return Turn(turn.question, turn.answer, tuple(sources))


def _chunk_source(chunk: Chunk, title: str, score: float = 0.0) -> Source:
    return Source(
        chunk_id=chunk.id,
        document_id=chunk.document_id,
        title=title,
        text=chunk.text,
        start=chunk.char_start,
        end=chunk.char_end,
        page=chunk.page,
        score=score,
    )


async def recover_chunk_ids(
    *, pipeline: QAPipeline, questions: list[str], tenant: str
) -> list[list[int]]:
    """The chunk ids each earlier question's turn added, found by retrieving it again (the same
    question over an unchanged index retrieves the same chunks), minus the chunks of the turns
    before it, in canonical order (a turn whose documents were moved to follow the cache is laid
    out again in that order). Assumes no chunk of those turns was dropped to fit the context
    window."""

    def retrieve_all() -> list[list[int]]:
        seen: set[int] = set()
        chunk_ids: list[list[int]] = []
        with pipeline.sessions() as session:
            for question in questions:
                hits = _retrieve(
                    session=session,
                    pipeline=pipeline,
                    question=question,
                    query=None,
                    scope=Scope(tenant),
                ).hits
                fresh = [to_source(hit) for hit in hits if hit.chunk_id not in seen]
                new = [s.chunk_id for s in sorted(fresh, key=lambda s: s.canonical_key)]
                chunk_ids.append(new)
                seen.update(new)
        return chunk_ids

    return await run_in_threadpool(retrieve_all)


def answer_stream(
    *, pipeline: QAPipeline, prepared: PreparedAnswer
) -> AsyncIterator[GenerationDelta | GenerationResult]:
    """The engine's stream for a prepared answer; closing it early aborts the generation.

    The stable head of the prompt (system prompt, tools, examples) is the same for everyone, so
    it is cached as public; the sources and the question are cached under the tenant's salt.
    """
    ids = prepared.prompt.token_ids
    cache_scope = prepared.scope.cache_scope(pipeline.prompts.stable_ids, ids)
    spans = tuple(
        ChunkSpan(start, length, (document_tag(document_id),))
        for start, length, document_id in prepared.prompt.body_spans
    )
    return pipeline.llm.generate(ids, prepared.params, cache_scope=cache_scope, chunk_spans=spans)


def citations(prepared: PreparedAnswer) -> list[CitationOut]:
    """Every source the answer may cite, by number: this turn's new sources and the retrieved
    ones an earlier turn laid out (under their original numbers)."""
    return [
        CitationOut(
            n=n,
            document_id=s.document_id,
            chunk_id=s.chunk_id,
            title=s.title,
            text=s.text,
            start=s.start,
            end=s.end,
            page=s.page,
            score=s.score,
            evidence=[
                EvidenceOut(
                    start=e.start,
                    end=e.end,
                    document_start=s.start + e.start,
                    document_end=s.start + e.end,
                    text=s.text[e.start : e.end],
                    score=e.score,
                )
                for e in prepared.evidence.get(s.chunk_id, ())
            ],
        )
        for n, s in prepared.prompt.numbered
    ]


def chunk_ids(prepared: PreparedAnswer) -> list[int]:
    """The chunks this turn added to the conversation, in prompt order (the client sends them
    back with the turn in `history`)."""
    return [s.chunk_id for s in prepared.prompt.sources]


def usage(result: GenerationResult) -> UsageOut:
    return UsageOut(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        blended_tokens=result.blended_tokens,
        recomputed_tokens=result.recomputed_tokens,
    )


def timings(prepared: PreparedAnswer, result: GenerationResult) -> dict[str, float]:
    """Retrieval stages, evidence spans, key lines, TTFT and TPOT of the engine, and the whole
    request, in ms."""
    return {
        "embed_ms": prepared.retrieval_ms.get("embed_ms", 0.0),
        "search_ms": prepared.retrieval_ms.get("search_ms", 0.0),
        "rerank_ms": prepared.retrieval_ms.get("rerank_ms", 0.0),
        "evidence_ms": prepared.retrieval_ms.get("evidence_ms", 0.0),
        "key_lines_ms": prepared.retrieval_ms.get("key_lines_ms", 0.0),
        "ttft_ms": result.ttft_s * 1000.0,
        "tpot_ms": result.tpot_s * 1000.0,
        "total_ms": (time.perf_counter() - prepared.started) * 1000.0,
    }


def to_source(hit: Hit[Chunk]) -> Source:
    """A search hit as a prompt source; the rerank score wins when there is one."""
    score = hit.rerank_score if hit.rerank_score is not None else hit.score
    return _chunk_source(hit.passage, hit.passage.document.title, score)


def _retrieve(
    *,
    session: Session,
    pipeline: QAPipeline,
    question: str,
    query: QueryIn | None,
    scope: Scope,
) -> RetrievalResult[Chunk]:
    settings = pipeline.settings
    top_k = (query.top_k if query else None) or settings.default_top_k
    candidates = (query.candidates if query else None) or settings.default_candidates
    return search(
        session=session,
        retriever=pipeline.retriever,
        scopes=pipeline.scopes,
        query=question,
        top_k=top_k,
        candidates=candidates,
        scope=scope,
    )
