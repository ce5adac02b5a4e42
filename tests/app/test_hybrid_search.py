"""Hybrid retrieval in the service: BM25 (in the database) stays equal to the ready chunks through
ingest, delete and restart, a restart rebuilds nothing, and filters apply inside the BM25 search
too (SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, select

from prefixrag.app.core.models import Chunk, Document
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.retrieval.embedder import Embedder
from tests.app.conftest import app_state, fresh_database, make_settings, started
from tests.app.helpers import HTML, MARKDOWN, PLAIN_TEXT, upload

# a made-up part number: only an exact-term (BM25) match can find it reliably
RARE = "Replace filter cartridge QX-7731 zorbulite every spring.\n\n" + PLAIN_TEXT


def db_ready_ids(client: TestClient) -> list[int]:
    state = app_state(client)
    assert state.sessions is not None
    with state.sessions() as session:
        query = select(Chunk.id).join(Document).where(Document.status == "ready")
        return sorted(session.scalars(query))


def lexical_ids(client: TestClient) -> list[int]:
    retriever = app_state(client).retriever
    assert retriever is not None and isinstance(retriever.lexical, DatabaseLexicalIndex)
    return retriever.lexical.ids().tolist()


@contextmanager
def recorded_sql() -> Iterator[list[str]]:
    """Every SQL statement any engine runs inside the block."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(Engine, "before_cursor_execute", record)


def search_ids(client: TestClient, query: str, **params: object) -> list[int]:
    response = client.post("/v1/search", json={"query": query, **params})
    assert response.status_code == 200, response.text
    return [hit["document_id"] for hit in response.json()["results"]]


def test_bm25_follows_ingest_delete_and_restart(tmp_path: Path, embedder: Embedder) -> None:
    for url in fresh_database("sqlite", tmp_path):
        settings = make_settings(tmp_path, url)
        assert settings.retrieval_mode == "hybrid"  # the default, chosen by the eval
        with started(settings, embedder) as client:
            assert lexical_ids(client) == []
            docs = {
                name: upload(client, name, data.encode()).json()["id"]
                for name, data in (("rare.txt", RARE), ("garden.md", MARKDOWN))
            }
            assert lexical_ids(client) == db_ready_ids(client)
            assert search_ids(client, "zorbulite QX-7731", top_k=1) == [docs["rare.txt"]]
            index = app_state(client).index
            assert index is not None
            assert client.delete(f"/v1/documents/{docs['rare.txt']}").status_code == 204
            assert lexical_ids(client) == db_ready_ids(client)
            assert np.asarray(index.ids()).tolist() == db_ready_ids(client)
            assert docs["rare.txt"] not in search_ids(client, "zorbulite QX-7731", top_k=5)
            upload(client, "volcano.html", HTML.encode())
            before = db_ready_ids(client)
        with recorded_sql() as statements, started(settings, embedder) as client:
            # consistent stores: the start read no chunk text and wrote no terms (no rebuild)
            assert not [s for s in statements if "chunks.text" in s or "INSERT" in s.upper()]
            assert lexical_ids(client) == before == db_ready_ids(client)
            assert search_ids(client, "volcano eruption", top_k=1)


def test_filters_apply_inside_bm25(tmp_path: Path, embedder: Embedder) -> None:
    for url in fresh_database("sqlite", tmp_path):
        with started(make_settings(tmp_path, url), embedder) as client:
            rare = upload(client, "rare.txt", RARE.encode()).json()["id"]
            garden = upload(client, "garden.md", MARKDOWN.encode(), collection="garden")
            garden_id = garden.json()["id"]
            # the best BM25 match is outside the filter; the filtered search must still fill up
            hits = search_ids(client, "zorbulite cartridge", collection="garden", top_k=3)
            assert hits and set(hits) == {garden_id}
            hits = search_ids(client, "zorbulite cartridge", document_ids=[garden_id], top_k=3)
            assert hits and set(hits) == {garden_id}
            assert search_ids(client, "zorbulite cartridge", top_k=1) == [rare]


def test_dense_mode_has_no_bm25(tmp_path: Path, embedder: Embedder) -> None:
    for url in fresh_database("sqlite", tmp_path):
        settings = make_settings(tmp_path, url).model_copy(update={"retrieval_mode": "dense"})
        with started(settings, embedder) as client:
            upload(client, "rare.txt", RARE.encode())
            retriever = app_state(client).retriever
            assert retriever is not None and retriever.lexical is None
            assert search_ids(client, "lighthouse lamp", top_k=1)
