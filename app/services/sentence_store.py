"""The chunks' evidence sentences, kept in the database next to the chunks.

Embedding a chunk's sentences costs about 0.1 s on two CPU cores, and the finder's cache lives
in memory: without a store, every question after a restart that cites a chunk not seen since
would wait on that (hundreds of ms). Ingest writes each new chunk's sentences once; a question
first restores what the finder is missing from the rows, and writes the rows of chunks that had
none (documents ingested before the store, or whose row no longer matches the embedder).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import ChunkSentences
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.evidence import EvidenceFinder, StoredSentences

logger = logging.getLogger(__name__)


def save_sentences(
    sessions: sessionmaker[Session],
    finder: EvidenceFinder,
    embedder: Embedder,
    chunk_ids: Sequence[int],
    texts: Sequence[str],
) -> None:
    """Embeds the sentences of these chunks (cached ones are not embedded again) and writes or
    replaces their rows in one transaction."""
    stored = finder.stored(texts, embedder)
    with sessions() as session:
        for chunk_id, sentences in zip(chunk_ids, stored, strict=True):
            session.merge(_row(chunk_id, sentences))
        session.commit()


def restore_sentences(
    sessions: sessionmaker[Session],
    finder: EvidenceFinder,
    embedder: Embedder,
    chunk_ids: Sequence[int],
    texts: Sequence[str],
) -> None:
    """Puts the stored sentences of the chunks the finder has not cached into its cache, and
    stores those that had no usable row (the finder embeds them now, as it would have in
    `find`). A failed write is logged: the answer does not depend on it."""
    missing = finder.missing(texts, embedder)
    if not missing:
        return
    wanted = {chunk_ids[n]: n for n in missing}
    with sessions() as session:
        rows = session.scalars(
            select(ChunkSentences).where(ChunkSentences.chunk_id.in_(list(wanted)))
        ).all()
    by_position = {wanted[row.chunk_id]: _stored(row, embedder.dim) for row in rows}
    finder.restore([texts[n] for n in missing], [by_position.get(n) for n in missing], embedder)
    unstored = finder.missing(texts, embedder)
    if not unstored:
        return
    try:
        save_sentences(
            sessions,
            finder,
            embedder,
            [chunk_ids[n] for n in unstored],
            [texts[n] for n in unstored],
        )
    except IntegrityError:  # the chunk was deleted meanwhile, or a question beside wrote it
        logger.debug("chunk sentences not stored", exc_info=True)


def _row(chunk_id: int, sentences: StoredSentences) -> ChunkSentences:
    return ChunkSentences(
        chunk_id=chunk_id,
        key=sentences.key,
        spans=np.ascontiguousarray(sentences.spans, dtype="<i4").tobytes(),
        vectors=np.ascontiguousarray(sentences.vectors, dtype="<f2").tobytes(),
    )


def _stored(row: ChunkSentences, dim: int) -> StoredSentences | None:
    """A row read back, or None when its sizes do not fit `dim` (another embedder's)."""
    spans = np.frombuffer(row.spans, dtype="<i4")
    vectors = np.frombuffer(row.vectors, dtype="<f2")
    if spans.size % 2 or vectors.size != spans.size // 2 * dim:
        return None
    return StoredSentences(
        bytes(row.key), spans.reshape(-1, 2), vectors.reshape(spans.size // 2, dim)
    )
