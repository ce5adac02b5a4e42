"""The service with settings.lexical_engine = "tantivy": ingest adds a document's chunks beside
their vectors, a delete removes them, collection filters apply, and start-up rebuilds a lost
index directory and repairs one a crash left out of step with the rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prefixrag.app.core.models import DEFAULT_TENANT
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.lexical import TantivyLexicalIndex
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from tests.app.conftest import app_state, make_settings, started
from tests.app.helpers import PLAIN_TEXT, chunk_ids, upload

OTHER_TEXT = "Zebras graze on the savanna.\n\nA zebra herd moves at dawn, watched by lions."


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url).model_copy(update={"lexical_engine": "tantivy"})


def lexical_of(client: TestClient) -> TantivyLexicalIndex:
    lexical = app_state(client).lexical_side
    assert isinstance(lexical, TantivyLexicalIndex)
    retriever = app_state(client).retriever
    assert retriever is not None and retriever.lexical is lexical  # hybrid search queries it
    return lexical


def test_ingest_and_delete_keep_the_index_equal_to_the_rows(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, embedder) as client:
        first = upload(client, "a.txt", PLAIN_TEXT.encode(), collection="one")
        second = upload(client, "z.txt", OTHER_TEXT.encode(), collection="two")
        assert first.status_code == second.status_code == 201
        lexical = lexical_of(client)
        assert set(lexical.ids().tolist()) == chunk_ids(client)
        zebra_chunks = chunk_ids(client, second.json()["id"])
        _, ids = lexical.search("zebra herd", 10)
        assert ids.size and set(ids.tolist()) <= zebra_chunks
        # a collection filter is applied inside the index
        assert lexical.search("zebra herd", 10, Scope(collection="one"))[1].size == 0
        _, ids = lexical.search("zebra herd", 10, Scope(tenant=DEFAULT_TENANT, collection="two"))
        assert set(ids.tolist()) <= zebra_chunks and ids.size
        assert lexical.search("zebra", 10, Scope(tenant="nobody"))[1].size == 0
        assert client.delete(f"/v1/documents/{second.json()['id']}").status_code == 204
        assert set(lexical.ids().tolist()) == chunk_ids(client)
        assert lexical.search("zebra herd", 10)[1].size == 0


def test_start_up_rebuilds_a_lost_index_and_repairs_a_stale_one(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, embedder) as client:
        assert upload(client, "a.txt", PLAIN_TEXT.encode()).status_code == 201
        assert upload(client, "z.txt", OTHER_TEXT.encode()).status_code == 201
        expected = chunk_ids(client)
        before = lexical_of(client).search("zebra herd dawn", 10)
    shutil.rmtree(settings.lexical_index_dir)
    with started(settings, embedder) as client:
        lexical = lexical_of(client)
        assert set(lexical.ids().tolist()) == expected
        after = lexical.search("zebra herd dawn", 10)
        assert after[1].tolist() == before[1].tolist()
    # what a crash between the two writes leaves: a chunk the rows lack, a row the index lacks
    store = TantivyLexical(settings.lexical_index_dir)
    dropped = min(expected)
    store.remove([dropped])
    store.add([10**9], [["zebra"]], document_ids=[10**9], collection_ids=[1])
    store.close()
    with started(settings, embedder) as client:
        lexical = lexical_of(client)
        assert set(lexical.ids().tolist()) == expected
        assert 10**9 not in lexical.search("zebra", 50)[1].tolist()


def test_a_failed_index_write_leaves_nothing_behind(
    settings: Settings, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(settings, embedder) as client:
        lexical = lexical_of(client)

        def broken(*args: object, **kwargs: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(lexical.store, "add", broken)
        response = upload(client, "a.txt", PLAIN_TEXT.encode())
        assert response.json()["status"] == "failed", response.json()
        assert chunk_ids(client) == set()
        assert lexical.ids().tolist() == []
        state = app_state(client)
        assert state.index is not None and len(state.index) == 0
