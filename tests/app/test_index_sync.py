"""iter_ready_chunks: every ready chunk exactly once, in id order, in batches of the given size;
ready_chunk_ids: the same ids, sorted, in one array."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services.index_sync import iter_ready_chunks, ready_chunk_ids
from tests.app.conftest import app_state
from tests.app.helpers import PLAIN_TEXT, chunk_ids, upload


def test_batches_cover_every_ready_chunk_once_in_id_order(client: TestClient) -> None:
    assert upload(client, "a.txt", PLAIN_TEXT.encode()).status_code == 201
    assert upload(client, "b.txt", (PLAIN_TEXT + " Again.").encode()).status_code == 201
    expected = sorted(chunk_ids(client))
    assert len(expected) >= 3  # enough for more than one batch of 2
    sessions = app_state(client).sessions
    assert sessions is not None
    batches = list(iter_ready_chunks(sessions=sessions, columns=(Chunk.text,), batch_size=2))
    assert all(1 <= len(batch) <= 2 for batch in batches)
    assert [row[0] for batch in batches for row in batch] == expected
    assert all(isinstance(row[1], str) and row[1] for batch in batches for row in batch)


def test_ready_chunk_ids_are_sorted_and_only_of_ready_documents(
    sessions: sessionmaker[Session],
) -> None:
    # the first document's chunks have the larger ids, as when a later upload finishes first
    chunks_of = {"ready": [10, 11, 3], "processing": [4, 12], "also ready": [1, 2, 7]}
    with sessions() as session:
        collection = Collection(name="c")
        session.add(collection)
        session.flush()
        for n, (title, ids) in enumerate(chunks_of.items()):
            status = "processing" if title == "processing" else "ready"
            doc = Document(
                collection_id=collection.id,
                title=title,
                media_type="text/plain",
                num_bytes=1,
                sha256=str(n) * 64,
                status=status,
            )
            session.add(doc)
            session.flush()
            for ordinal, chunk_id in enumerate(ids):
                session.add(_chunk(chunk_id, doc.id, ordinal))
        session.commit()
        got = ready_chunk_ids(session=session)
    assert got.dtype == np.int64
    assert got.tolist() == [1, 2, 3, 7, 10, 11]
    with sessions() as session:
        session.query(Document).update({"status": "failed"})
        session.commit()
        assert ready_chunk_ids(session=session).tolist() == []


def _chunk(chunk_id: int, document_id: int, ordinal: int) -> Chunk:
    return Chunk(
        id=chunk_id,
        document_id=document_id,
        ordinal=ordinal,
        text=f"chunk {chunk_id}",
        char_start=0,
        char_end=1,
        num_tokens=1,
    )
