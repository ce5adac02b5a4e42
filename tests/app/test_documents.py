"""Upload, list, get and delete documents through the HTTP API."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
from fastapi.testclient import TestClient

from prefixrag.app.core.errors import DuplicateDocumentError
from prefixrag.app.services.ingest import IngestRequest
from tests.app.conftest import app_state
from tests.app.helpers import (
    HTML,
    MARKDOWN,
    PLAIN_TEXT,
    chunk_ids,
    index_ids,
    make_pdf,
    upload,
)


def test_each_supported_type_becomes_ready(client: TestClient) -> None:
    pdf = make_pdf(["First page about apples.", "Second page about pears."])
    cases = [
        ("notes.txt", PLAIN_TEXT.encode(), "text/plain"),
        ("garden.md", MARKDOWN.encode(), "text/markdown"),
        ("volcano.html", HTML.encode(), "text/html"),
        ("fruit.pdf", pdf, "application/pdf"),
    ]
    for name, data, media_type in cases:
        response = upload(client, name, data)
        assert response.status_code == 201, response.text
        doc = response.json()
        assert doc["status"] == "ready", doc
        assert doc["media_type"] == media_type
        assert doc["filename"] == name
        assert doc["num_bytes"] == len(data)
        assert doc["sha256"] == hashlib.sha256(data).hexdigest()
        assert doc["num_chunks"] >= 1
        assert chunk_ids(client, doc["id"]) <= index_ids(client)
    assert index_ids(client) == chunk_ids(client)


def test_background_upload_answers_202_then_becomes_ready(client: TestClient) -> None:
    meta = {"source": "unit-test", "tags": ["a", "b"]}
    response = upload(client, "bg.txt", PLAIN_TEXT.encode(), wait=False, metadata=json.dumps(meta))
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "pending"
    ingest = app_state(client).ingest
    assert ingest is not None and ingest.wait_idle(60)
    doc = client.get(f"/v1/documents/{body['document_id']}").json()
    assert doc["status"] == "ready"
    assert doc["metadata"] == meta
    assert doc["error"] is None
    assert doc["num_chunks"] == len(chunk_ids(client, doc["id"]))


def test_json_text_body(client: TestClient) -> None:
    response = client.post(
        "/v1/documents?wait=true",
        json={"text": PLAIN_TEXT, "title": "Keeper", "collection": "sea", "metadata": {"k": 1}},
    )
    assert response.status_code == 201, response.text
    doc = response.json()
    assert (doc["title"], doc["collection"], doc["metadata"]) == ("Keeper", "sea", {"k": 1})
    assert doc["media_type"] == "text/plain"
    assert doc["num_bytes"] == len(PLAIN_TEXT.encode())


def test_list_paginates_and_filters_by_collection(client: TestClient) -> None:
    ids = {}
    for i in range(5):
        collection = "even" if i % 2 == 0 else "odd"
        text = f"Document number {i} talks about topic {i * 7}."
        response = upload(client, f"d{i}.txt", text.encode(), collection=collection)
        ids[i] = response.json()["id"]
    page1 = client.get("/v1/documents", params={"limit": 2}).json()
    page2 = client.get("/v1/documents", params={"limit": 2, "offset": 2}).json()
    page3 = client.get("/v1/documents", params={"limit": 2, "offset": 4}).json()
    assert page1["total"] == page2["total"] == 5
    listed = [d["id"] for page in (page1, page2, page3) for d in page["items"]]
    assert listed == sorted(ids.values())
    even = client.get("/v1/documents", params={"collection": "even"}).json()
    assert even["total"] == 3
    assert {d["id"] for d in even["items"]} == {ids[0], ids[2], ids[4]}
    assert all(d["collection"] == "even" for d in even["items"])
    empty = client.get("/v1/documents", params={"collection": "nope"}).json()
    assert empty == {"items": [], "total": 0, "limit": 20, "offset": 0}


def test_get_and_delete_unknown_ids_are_404(client: TestClient) -> None:
    for response in (client.get("/v1/documents/999"), client.delete("/v1/documents/999")):
        assert response.status_code == 404
        assert "999" in response.json()["detail"]


def test_delete_removes_rows_and_vectors(client: TestClient) -> None:
    keep = upload(client, "keep.md", MARKDOWN.encode()).json()
    gone = upload(client, "gone.txt", PLAIN_TEXT.encode()).json()
    gone_chunks = chunk_ids(client, gone["id"])
    assert gone_chunks and gone_chunks <= index_ids(client)
    assert client.delete(f"/v1/documents/{gone['id']}").status_code == 204
    assert client.get(f"/v1/documents/{gone['id']}").status_code == 404
    assert chunk_ids(client, gone["id"]) == set()
    assert not gone_chunks & index_ids(client)
    assert index_ids(client) == chunk_ids(client, keep["id"])
    hits = client.post("/v1/search", json={"query": "lighthouse keeper lamp"}).json()["results"]
    assert all(hit["document_id"] == keep["id"] for hit in hits)


def test_same_content_in_same_collection_is_409(client: TestClient) -> None:
    first = upload(client, "a.txt", PLAIN_TEXT.encode()).json()
    again = upload(client, "renamed.txt", PLAIN_TEXT.encode())
    assert again.status_code == 409
    assert again.json()["document_id"] == first["id"]
    assert "already exists" in again.json()["detail"]
    as_json = client.post("/v1/documents", json={"text": PLAIN_TEXT})
    assert as_json.status_code == 409
    other_collection = upload(client, "a.txt", PLAIN_TEXT.encode(), collection="other")
    assert other_collection.status_code == 201
    assert client.get("/v1/documents").json()["total"] == 2
    assert index_ids(client) == chunk_ids(client)


def test_concurrent_uploads_of_the_same_content_store_it_once(client: TestClient) -> None:
    ingest = app_state(client).ingest
    assert ingest is not None
    num_threads = 6
    barrier = threading.Barrier(num_threads)
    outcomes: list[object] = []
    lock = threading.Lock()

    def submit() -> None:
        request = IngestRequest(data=MARKDOWN.encode(), filename="same.md", collection="race")
        barrier.wait()
        try:
            result: object = ingest.submit(request).document_id
        except DuplicateDocumentError as exc:
            result = exc
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=submit) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = [o for o in outcomes if isinstance(o, int)]
    duplicates = [o for o in outcomes if isinstance(o, DuplicateDocumentError)]
    assert len(accepted) == 1 and len(duplicates) == num_threads - 1
    assert {d.document_id for d in duplicates} == set(accepted)
    assert ingest.wait_idle(60)
    assert client.get("/v1/documents", params={"collection": "race"}).json()["total"] == 1
    assert index_ids(client) == chunk_ids(client, accepted[0])


@pytest.mark.parametrize("document_id", [0, -1, 2**31, 2**63])
def test_ids_that_cannot_exist_are_422_on_every_database(client: TestClient, document_id: int):
    # PostgreSQL ids are 32-bit: a bigger one must not reach the database (it answered 500)
    for response in (
        client.get(f"/v1/documents/{document_id}"),
        client.delete(f"/v1/documents/{document_id}"),
        client.post("/v1/search", json={"query": "x", "document_ids": [document_id]}),
        client.post("/v1/query", json={"question": "x", "document_ids": [document_id]}),
    ):
        assert response.status_code == 422, response.text
        assert response.json()["detail"]
    assert client.get(f"/v1/documents/{2**31 - 1}").status_code == 404
