"""iter_ready_chunks: every ready chunk exactly once, in id order, in batches of the given size."""

from __future__ import annotations

from fastapi.testclient import TestClient

from prefixrag.app.core.models import Chunk
from prefixrag.app.services.index_sync import iter_ready_chunks
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
