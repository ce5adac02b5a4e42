"""The one write path for documents, chunks and their vectors.

Parsing runs in the caller (so bad input is refused before anything is stored); chunking,
embedding and indexing run on a bounded worker pool. A document ends `ready` with all its chunk
rows and vectors, or `failed` with none of them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.errors import (
    DocumentBusyError,
    DocumentNotFoundError,
    DuplicateDocumentError,
    InvalidInputError,
    PayloadTooLargeError,
    QueueFullError,
    ServiceError,
    UnsupportedTypeError,
)
from prefixrag.app.core.lexical import insert_chunk_terms
from prefixrag.app.core.models import DEFAULT_TENANT, Chunk, Document
from prefixrag.app.services.collections import get_or_create_collection
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import searchable_text
from prefixrag.retrieval.parsing import (
    DocumentParseError,
    ParsedDocument,
    UnsupportedMediaTypeError,
    detect_media_type,
    parse_document,
)

if TYPE_CHECKING:
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.app.services.scopes import ScopeCache
    from prefixrag.retrieval.chunking import Chunk as TextChunk
    from prefixrag.retrieval.chunking import Chunker
    from prefixrag.retrieval.embedder import Embedder
    from prefixrag.retrieval.vector_index import VectorIndex

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000


@dataclass(slots=True)
class IngestRequest:
    """One document to ingest: its bytes plus how to file it."""

    data: bytes
    filename: str | None = None
    declared_type: str | None = None
    title: str | None = None
    collection: str = "default"
    metadata: dict[str, Any] = field(default_factory=dict)
    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, dict):
            raise InvalidInputError("metadata must be a JSON object")
        if not self.collection or len(self.collection) > 200:
            raise InvalidInputError("collection must be 1 to 200 characters")
        if not self.data:
            raise InvalidInputError("the document is empty (0 bytes)")


@dataclass(slots=True, frozen=True)
class IngestOutcome:
    """How a background ingestion ended: "ready", or "failed" with the reason."""

    status: str
    error: str | None = None


@dataclass(slots=True)
class IngestTicket:
    """A queued document; `future` resolves to its IngestOutcome (it never raises)."""

    document_id: int
    future: Future[IngestOutcome]


class IngestService:
    """Owns the ingest worker pool and every write to documents, chunks and the chunk indexes.

    The chunk indexes are the vector index and the chunks' BM25 terms in the database. The terms
    are written in every retrieval mode (so switching to hybrid needs no rebuild), in the
    transaction of the chunk rows, with `analyzer` (the one the lexical search queries with).
    `on_ready` is called with a document's chunk ids and texts once it is ready (to warm and
    store derived data such as evidence sentences; a
    failure there is logged and leaves the document ready). `scopes`, the searches' cached
    bitmaps of allowed chunk ids, learns of every chunk made ready or deleted.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        embedder: Embedder,
        index: VectorIndex,
        chunker: Chunker,
        *,
        scopes: ScopeCache,
        max_upload_bytes: int,
        num_workers: int = 1,
        queue_size: int = 64,
        analyzer: Analyzer | None = None,
        on_ready: Callable[[list[int], list[str]], None] | None = None,
        lexical_side: TantivyLexicalIndex | None = None,
    ) -> None:
        if num_workers < 1 or queue_size < 1:
            raise ValueError("num_workers and queue_size must be at least 1")
        self._sessions = sessions
        self._embedder = embedder
        self._index = index
        # the tantivy BM25 index (settings.lexical_engine), kept beside the vectors
        self._lexical_side = lexical_side
        self._analyzer = analyzer if analyzer is not None else Analyzer()
        self._on_ready = on_ready
        self._scopes = scopes
        self._chunker = chunker
        self._max_upload_bytes = max_upload_bytes
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="ingest")
        # Bounds queued + running jobs so a flood of uploads cannot pile up parsed documents.
        self._slots = threading.BoundedSemaphore(num_workers + queue_size)
        self._in_flight: set[Future[IngestOutcome]] = set()
        self._in_flight_lock = threading.Lock()

    def submit(self, request: IngestRequest) -> IngestTicket:
        """Validate and parse `request`, store it as `pending`, and queue its ingestion.

        Raises UnsupportedTypeError, PayloadTooLargeError, InvalidInputError,
        DuplicateDocumentError or QueueFullError; nothing is stored when it raises.
        """
        if len(request.data) > self._max_upload_bytes:
            raise PayloadTooLargeError(
                f"document is {len(request.data)} bytes; the limit is {self._max_upload_bytes}"
            )
        parsed = _parse(request)
        if not self._slots.acquire(blocking=False):
            raise QueueFullError("the ingest queue is full; retry later")
        try:
            document_id = self._insert_pending(request, parsed)
            future = self._pool.submit(self._run_job, document_id, parsed)
        except BaseException:
            self._slots.release()
            raise
        with self._in_flight_lock:
            self._in_flight.add(future)
        future.add_done_callback(self._forget)
        return IngestTicket(document_id, future)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued ingestion has finished; False if `timeout` ran out first."""
        with self._in_flight_lock:
            pending = set(self._in_flight)
        _, not_done = wait(pending, timeout=timeout)
        return not not_done

    def delete(self, document_id: int, tenant: str | None = None) -> None:
        """Remove a document, its chunk rows and their vectors; the index is saved after.
        The chunks' BM25 terms go with the rows (same delete), and from a tantivy index with
        the vectors. With `tenant`, another tenant's
        document is not found."""
        with self._sessions() as session:
            doc = session.get(Document, document_id)
            if doc is None or (tenant is not None and doc.collection.tenant != tenant):
                raise DocumentNotFoundError(document_id)
            if doc.status in ("pending", "processing"):
                raise DocumentBusyError(f"document {document_id} is still being ingested")
            chunk_ids = list(session.scalars(select(Chunk.id).where(Chunk.document_id == doc.id)))
            session.execute(delete(Chunk).where(Chunk.document_id == doc.id))
            session.delete(doc)
            session.commit()
        self._scopes.note_removed(np.asarray(chunk_ids, dtype=np.int64))
        # Rows go first: a crash in between leaves orphan vectors, which search skips and the
        # start-up reconcile removes; the other order would leave unsearchable rows.
        if chunk_ids:
            self._remove_from_indexes(np.asarray(chunk_ids, dtype=np.int64))

    def close(self, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stop the worker pool. Cancelled jobs leave their documents `pending`, which the next
        start marks failed."""
        self._pool.shutdown(wait=wait, cancel_futures=cancel_pending)

    def _forget(self, future: Future[IngestOutcome]) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(future)

    def _insert_pending(self, request: IngestRequest, parsed: ParsedDocument) -> int:
        sha = hashlib.sha256(request.data).hexdigest()
        collection_id = get_or_create_collection(
            sessions=self._sessions, name=request.collection, tenant=request.tenant
        )
        with self._sessions() as session:
            existing = _find_by_content(session, collection_id, sha)
            if existing is not None and existing.status != "failed":
                raise DuplicateDocumentError(existing.id, request.collection)
            if existing is not None:
                # A failed attempt holds no chunks or vectors: let the new upload replace it.
                session.delete(existing)
                session.flush()
            doc = Document(
                collection_id=collection_id,
                title=_title(request, parsed),
                filename=request.filename,
                media_type=parsed.media_type,
                num_bytes=len(request.data),
                sha256=sha,
                status="pending",
                meta=request.metadata,
            )
            session.add(doc)
            try:
                session.commit()
            except IntegrityError:
                # A concurrent upload of the same content won the unique constraint.
                session.rollback()
                winner = _find_by_content(session, collection_id, sha)
                if winner is None:
                    raise
                raise DuplicateDocumentError(winner.id, request.collection) from None
            return doc.id

    def _run_job(self, document_id: int, parsed: ParsedDocument) -> IngestOutcome:
        try:
            self._set_status(document_id, "processing")
            self._index_document(document_id, parsed)
            return IngestOutcome("ready")
        except Exception as exc:
            logger.exception("ingest of document %d failed", document_id)
            reason = _reason(exc)
            self._set_status(document_id, "failed", error=reason)
            return IngestOutcome("failed", reason)
        finally:
            self._slots.release()

    def _index_document(self, document_id: int, parsed: ParsedDocument) -> None:
        chunks = self._chunker.split(parsed)
        if not chunks:
            raise InvalidInputError("the document has no text to index")
        vectors = self._embedder.encode([c.text for c in chunks])
        added: np.ndarray | None = None
        try:
            with self._sessions() as session:
                rows = [_chunk_row(document_id, c) for c in chunks]
                session.add_all(rows)
                session.flush()
                ids = np.asarray([r.id for r in rows], dtype=np.int64)
                texts = [searchable_text(c.text, c.heading) for c in chunks]
                insert_chunk_terms(session, self._analyzer, ids.tolist(), texts)
                added = ids
                self._index.add(ids, vectors)
                self._index.save()
                doc = session.get(Document, document_id)
                if doc is None:
                    raise DocumentNotFoundError(document_id)
                if self._lexical_side is not None:
                    self._lexical_side.add(
                        ids, texts, document_id=document_id, collection_id=doc.collection_id
                    )
                doc.status, doc.error = "ready", None
                scope = (doc.collection.tenant, doc.collection.name)
                session.commit()
        except BaseException:
            if added is not None:
                self._remove_from_indexes(added)
            raise
        self._scopes.note_ready(tenant=scope[0], collection=scope[1], chunk_ids=ids)
        if self._on_ready is not None:
            try:
                self._on_ready(ids.tolist(), [c.text for c in chunks])
            except Exception:  # a cache that could not warm costs a later question, not this
                logger.exception("warming caches for document %d failed", document_id)

    def _remove_from_indexes(self, ids: np.ndarray) -> None:
        self._index.remove(ids)
        self._index.save()
        if self._lexical_side is not None:
            self._lexical_side.remove(ids)

    def _set_status(self, document_id: int, status: str, error: str | None = None) -> None:
        with self._sessions() as session:
            doc = session.get(Document, document_id)
            if doc is None:
                raise DocumentNotFoundError(document_id)
            doc.status, doc.error = status, error
            session.commit()


def _parse(request: IngestRequest) -> ParsedDocument:
    try:
        media_type = detect_media_type(request.filename, request.declared_type)
    except UnsupportedMediaTypeError as exc:
        raise UnsupportedTypeError(str(exc)) from exc
    try:
        parsed = parse_document(request.data, media_type)
    except DocumentParseError as exc:
        raise InvalidInputError(f"cannot read the document: {exc}") from exc
    if not parsed.text.strip():
        raise InvalidInputError("the document contains no text")
    return parsed


def _find_by_content(session: Session, collection_id: int, sha: str) -> Document | None:
    query = select(Document).where(Document.collection_id == collection_id, Document.sha256 == sha)
    return session.scalar(query)


def _title(request: IngestRequest, parsed: ParsedDocument) -> str:
    if request.title and request.title.strip():
        return request.title.strip()[:500]
    if parsed.title:
        return parsed.title[:500]
    if request.filename:
        return request.filename[:500]
    first_line = parsed.text.strip().splitlines()[0]
    return first_line[:80]


def _chunk_row(document_id: int, chunk: TextChunk) -> Chunk:
    return Chunk(
        document_id=document_id,
        ordinal=chunk.ordinal,
        text=chunk.text,
        char_start=chunk.start,
        char_end=chunk.end,
        page=chunk.page,
        num_tokens=chunk.num_tokens,
        heading=chunk.heading or None,
    )


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ServiceError) else str(exc)
    return text[:MAX_ERROR_CHARS]
