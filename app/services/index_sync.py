"""Keep the side indexes equal to the ready chunks: repair FAISS (and a tantivy BM25 index, when
settings.lexical_engine asks for one) at start, and rebuild them on demand. The database's own
BM25 terms live with the rows, so they never need this."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import Chunk, Document
from prefixrag.retrieval.lexical.terms import index_terms, searchable_text

if TYPE_CHECKING:
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.retrieval.embedder import Embedder
    from prefixrag.retrieval.vector_index import VectorIndex

logger = logging.getLogger(__name__)

INTERRUPTED_REASON = "interrupted by restart"


@dataclass(slots=True)
class ReconcileReport:
    """What the start-up check found: ids only in the index, ids only in the DB, and the action."""

    num_db_ids: int
    num_orphan_vectors: int
    num_missing_vectors: int
    repaired: bool

    @property
    def is_consistent(self) -> bool:
        """True when the index held exactly the ready chunk ids before any repair."""
        return self.num_orphan_vectors == 0 and self.num_missing_vectors == 0


# NOTE: no ORDER BY: sorting in SQL made SQLite scan the whole chunks table (texts included)
# instead of two covering indexes, 5-10x slower at a million chunks; numpy sorts after.
_READY_CHUNK_IDS = (
    "SELECT chunks.id FROM chunks JOIN documents ON documents.id = chunks.document_id "
    "WHERE documents.status = 'ready'"
)
_SQLITE_READY_CHUNK_IDS = _READY_CHUNK_IDS.replace("chunks.id", "group_concat(chunks.id)", 1)


def ready_chunk_ids(*, session: Session) -> np.ndarray:
    """Ids of every chunk whose document is ready, sorted, as int64."""
    # Start-up's largest read (a million ids at a million chunks): the driver's own cursor, not
    # ORM or Core rows, whose per-row processing made it 2-3x slower (bench/startup_bench.py).
    cursor = session.connection().connection.cursor()
    try:
        if session.get_bind().dialect.name == "sqlite":
            ids = _ids_as_one_string(cursor)
        else:
            ids = _ids_row_by_row(cursor)
    finally:
        cursor.close()
    return np.sort(ids)


def _ids_as_one_string(cursor: Any) -> np.ndarray:
    # One comma-separated string: no Python object per row, and the GIL stays free while SQLite
    # works (start-up reads the ids beside the embedder's import).
    cursor.execute(_SQLITE_READY_CHUNK_IDS)
    joined = cursor.fetchone()[0]
    if not joined:
        return np.zeros(0, dtype=np.int64)
    ids = np.fromstring(joined, dtype=np.int64, sep=",")
    if len(ids) != joined.count(",") + 1:
        raise RuntimeError("could not parse the ready chunk ids the database returned")
    return ids


def _ids_row_by_row(cursor: Any) -> np.ndarray:
    blocks: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    cursor.execute(_READY_CHUNK_IDS)
    while rows := cursor.fetchmany(65536):
        blocks.append(np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows)))
    return np.concatenate(blocks)


def reconcile_index(
    *,
    sessions: sessionmaker[Session],
    index: VectorIndex,
    embedder: Embedder,
    db_ids: np.ndarray | None = None,
) -> ReconcileReport:
    """Make the index hold exactly the ready chunk ids, and save it if that changed anything.

    Vectors no ready chunk owns (a crash between a delete's commit and its index save, or
    between an ingest's index save and its commit) are removed; ready chunks without a vector
    (an index file lost or unreadable) are embedded again. Vectors of the ids both sides hold
    are kept: the database never reuses an id the index still holds, because this runs before
    the ingest service starts. `db_ids`: the ready chunk ids (`ready_chunk_ids`) when the
    caller has read them already, with no ingest or delete since.
    """
    if db_ids is None:
        with sessions() as session:
            db_ids = ready_chunk_ids(session=session)
    index_ids = np.sort(np.asarray(index.ids(), dtype=np.int64))
    if np.array_equal(index_ids, db_ids):
        # the usual start: one linear comparison instead of two set differences (seconds at 1M)
        logger.info("vector index is consistent with the database (%d vectors)", len(db_ids))
        return ReconcileReport(len(db_ids), 0, 0, repaired=False)
    # both sides hold each id once (the index refuses a known id; chunk ids are a primary key)
    orphans = np.setdiff1d(index_ids, db_ids, assume_unique=True)
    missing = np.setdiff1d(db_ids, index_ids, assume_unique=True)
    report = ReconcileReport(len(db_ids), len(orphans), len(missing), repaired=False)
    logger.warning(
        "vector index out of sync with the database: %d vectors without a ready chunk "
        "(e.g. %s), %d ready chunks without a vector (e.g. %s); repairing from the database",
        len(orphans),
        orphans[:5].tolist(),
        len(missing),
        missing[:5].tolist(),
    )
    index.remove(orphans)
    _embed_chunks(sessions, index, embedder, missing)
    index.save()
    report.repaired = True
    return report


def _embed_chunks(
    sessions: sessionmaker[Session],
    index: VectorIndex,
    embedder: Embedder,
    chunk_ids: np.ndarray,
    batch_size: int = 256,
) -> None:
    with sessions() as session:
        for start in range(0, len(chunk_ids), batch_size):
            wanted = [int(i) for i in chunk_ids[start : start + batch_size]]
            rows = session.execute(
                select(Chunk.id, Chunk.text).where(Chunk.id.in_(wanted)).order_by(Chunk.id)
            ).all()
            ids = np.asarray([r[0] for r in rows], dtype=np.int64)
            index.add(ids, embedder.encode([r[1] for r in rows]))


def reconcile_lexical(
    *,
    sessions: sessionmaker[Session],
    lexical: TantivyLexicalIndex,
    db_ids: np.ndarray | None = None,
    batch_size: int = 4096,
) -> ReconcileReport:
    """Make the tantivy BM25 index hold exactly the ready chunk ids, as reconcile_index does for
    the vectors: chunks no ready row owns are dropped, ready rows it lacks (a crash between the
    two writes, a new or lost index directory) are analyzed from their text and added.
    `db_ids`: as for reconcile_index."""
    if db_ids is None:
        with sessions() as session:
            db_ids = ready_chunk_ids(session=session)
    held = lexical.ids()
    if np.array_equal(held, db_ids):
        logger.info("tantivy BM25 index is consistent with the database (%d chunks)", len(db_ids))
        return ReconcileReport(len(db_ids), 0, 0, repaired=False)
    orphans = np.setdiff1d(held, db_ids, assume_unique=True)
    missing = np.setdiff1d(db_ids, held, assume_unique=True)
    logger.warning(
        "tantivy BM25 index out of sync with the database: %d chunks without a ready row, "
        "%d ready chunks missing; repairing from the database",
        len(orphans),
        len(missing),
    )
    lexical.remove(orphans)
    columns = (Chunk.id, Chunk.text, Chunk.heading, Chunk.document_id, Document.collection_id)
    with sessions() as session:
        for start in range(0, len(missing), batch_size):
            wanted = [int(i) for i in missing[start : start + batch_size]]
            rows = session.execute(
                select(*columns).join(Document).where(Chunk.id.in_(wanted))
            ).all()
            lexical.store.add(
                [r[0] for r in rows],
                [index_terms(lexical.analyzer, searchable_text(r[1], r[2])) for r in rows],
                document_ids=[r[3] for r in rows],
                collection_ids=[r[4] for r in rows],
            )
            if start and start % (64 * batch_size) == 0:
                logger.info("tantivy BM25 index: %d of %d chunks added", start, len(missing))
    return ReconcileReport(len(db_ids), len(orphans), len(missing), repaired=True)


def iter_ready_chunks(
    *, sessions: sessionmaker[Session], columns: tuple[Any, ...], batch_size: int
) -> Iterator[Sequence[Any]]:
    """Rows (id, *columns) of every ready chunk in id order, `batch_size` at a time.

    Keyset pagination (id > last id), so a large corpus is never loaded whole and no batch is
    skipped or repeated the way OFFSET could be.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    last_id = -1
    with sessions() as session:
        while True:
            rows = session.execute(
                select(Chunk.id, *columns)
                .join(Document)
                .where(Document.status == "ready", Chunk.id > last_id)
                .order_by(Chunk.id)
                .limit(batch_size)
            ).all()
            if not rows:
                return
            yield rows
            last_id = int(rows[-1][0])


def rebuild_index(
    *,
    sessions: sessionmaker[Session],
    index: VectorIndex,
    embedder: Embedder,
    batch_size: int = 256,
) -> int:
    """Empty the index, re-embed every ready chunk's text, save; returns the vector count."""
    index.reset()
    num_vectors = 0
    for rows in iter_ready_chunks(sessions=sessions, columns=(Chunk.text,), batch_size=batch_size):
        ids = np.asarray([r[0] for r in rows], dtype=np.int64)
        index.add(ids, embedder.encode([r[1] for r in rows]))
        num_vectors += len(rows)
    index.save()
    logger.info("rebuilt the vector index: %d vectors", num_vectors)
    return num_vectors


def fail_interrupted(*, sessions: sessionmaker[Session]) -> int:
    """Mark documents left pending/processing by a previous run as failed; returns how many.

    Their raw bytes are not kept, so they cannot be re-queued; any chunk rows a crash left
    behind are deleted so that a failed document never holds chunks.
    """
    with sessions() as session:
        stuck = list(
            session.scalars(
                select(Document.id).where(Document.status.in_(("pending", "processing")))
            )
        )
        if not stuck:
            return 0
        session.execute(delete(Chunk).where(Chunk.document_id.in_(stuck)))
        session.execute(
            update(Document)
            .where(Document.id.in_(stuck))
            .values(status="failed", error=INTERRUPTED_REASON)
        )
        session.commit()
    logger.warning("marked %d interrupted documents as failed: %s", len(stuck), stuck[:20])
    return len(stuck)
