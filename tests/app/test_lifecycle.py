"""Readiness, ingestion failures, and the start-up reconcile of the index with the database."""

from __future__ import annotations

import threading

import numpy as np
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from prefixrag.app.core.models import Document
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.index_sync import INTERRUPTED_REASON
from prefixrag.app.state import AppState, ComponentLoader
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.reranker import NOT_INSTALLED
from prefixrag.retrieval.vector_index import VectorIndex
from tests.app.conftest import app_state, started
from tests.app.helpers import MARKDOWN, PLAIN_TEXT, chunk_ids, index_ids, upload

POISON = "EXPLODING-SENTENCE"


class FailingEmbedder:
    """The real embedder, except that encoding any text containing POISON raises."""

    def __init__(self, inner: Embedder) -> None:
        self._inner = inner
        self.dim = inner.dim

    def count_tokens(self, text: str) -> int:
        return self._inner.count_tokens(text)

    def encode(self, texts: list[str], show_progress: bool = False) -> np.ndarray:
        if any(POISON in t for t in texts):
            raise RuntimeError("embedding backend crashed")
        return self._inner.encode(texts, show_progress)

    def encode_query(self, text: str) -> np.ndarray:
        return self._inner.encode_query(text)


def test_healthz_at_once_readyz_503_until_a_slow_loader_finishes(
    settings: Settings, embedder: Embedder
) -> None:
    release = threading.Event()

    def slow(_: AppState) -> str | None:
        if not release.wait(60):
            raise TimeoutError("never released")
        return None

    with started_without_waiting(settings, embedder, ComponentLoader("slow", slow)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        waiting = client.get("/readyz")
        assert waiting.status_code == 503
        assert waiting.json()["components"]["slow"] == "loading"
        release.set()
        assert app_state(client).wait_loaded(60)
        ready = client.get("/readyz")
        assert ready.status_code == 200
        components = ready.json()["components"]
        assert {components[name] for name in ("db", "embedder", "index", "slow")} == {"ok"}
        assert components["reranker"] == NOT_INSTALLED


class started_without_waiting(started):
    def __init__(self, settings: Settings, embedder: Embedder, loader: ComponentLoader) -> None:
        super().__init__(settings, embedder, extra_loaders=[loader])

    def __enter__(self) -> TestClient:
        return self._client.__enter__()


def test_a_failing_required_loader_keeps_readyz_503(settings: Settings, embedder: Embedder) -> None:
    def broken(_: AppState) -> str | None:
        raise RuntimeError("weights missing")

    with started(settings, embedder, extra_loaders=[ComponentLoader("llm", broken)]) as client:
        response = client.get("/readyz")
        assert response.status_code == 503
        assert response.json()["components"]["llm"] == "error: RuntimeError: weights missing"


def test_failure_during_background_ingestion_leaves_nothing(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, FailingEmbedder(embedder)) as client:
        good = upload(client, "good.md", MARKDOWN.encode()).json()
        before = index_ids(client)
        text = f"{PLAIN_TEXT}\n\nThis paragraph holds the {POISON} marker."
        response = upload(client, "bad.txt", text.encode(), wait=False)
        assert response.status_code == 202
        ingest = app_state(client).ingest
        assert ingest is not None and ingest.wait_idle(60)
        doc = client.get(f"/v1/documents/{response.json()['document_id']}").json()
        assert doc["status"] == "failed"
        assert "embedding backend crashed" in doc["error"]
        assert doc["num_chunks"] == 0
        assert chunk_ids(client, doc["id"]) == set()
        assert index_ids(client) == before == chunk_ids(client, good["id"])
        # A failed document does not block a retry of the same content.
        retry = upload(client, "bad.txt", text.encode())
        assert retry.status_code == 201 and retry.json()["status"] == "failed"


def test_restart_rebuilds_a_stale_index_and_fails_interrupted_documents(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, embedder) as client:
        first = upload(client, "a.txt", PLAIN_TEXT.encode()).json()
        second = upload(client, "b.md", MARKDOWN.encode()).json()
        expected = chunk_ids(client)
        second_chunks = chunk_ids(client, second["id"])
        sessions = app_state(client).sessions
        assert sessions is not None
    # Make the saved index stale: drop one document's vectors, add a vector nothing owns.
    stale = VectorIndex.open(settings.index_path, embedder.dim, use_gpu="no")
    stale.remove(np.asarray(sorted(second_chunks), np.int64))
    stale.add(np.asarray([10**9], np.int64), embedder.encode(["orphan vector"]))
    stale.save()
    with sessions() as session:
        session.add(_stuck_document(session, first["id"]))
        session.commit()
    with started(settings, embedder) as client:
        assert index_ids(client) == expected  # the orphan is gone, the missing vectors are back
        listed = client.get("/v1/documents").json()["items"]
        stuck = [d for d in listed if d["title"] == "stuck"]
        assert stuck[0]["status"] == "failed" and stuck[0]["error"] == INTERRUPTED_REASON
        best = client.post("/v1/search", json={"query": "aphids soapy water"}).json()
        assert best["results"][0]["document_id"] == second["id"]


def _stuck_document(session: Session, like_id: int) -> Document:
    original = session.get(Document, like_id)
    if original is None:
        raise LookupError(like_id)
    return Document(
        collection_id=original.collection_id,
        title="stuck",
        filename="stuck.txt",
        media_type="text/plain",
        num_bytes=5,
        sha256="0" * 64,
        status="processing",
        meta={},
    )
