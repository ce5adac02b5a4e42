"""Bad uploads get the right status, a JSON body that says what is wrong, and store nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.app.helpers import PLAIN_TEXT, chunk_ids, index_ids, upload


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """Input validation does not depend on the database: SQLite only, to keep this file fast."""
    return f"sqlite:///{tmp_path / 'test.db'}"


def assert_nothing_stored(client: TestClient) -> None:
    assert client.get("/v1/documents").json()["total"] == 0
    assert index_ids(client) == set()
    assert chunk_ids(client) == set()


@pytest.mark.parametrize(
    ("name", "content_type"),
    [("photo.png", "image/png"), ("archive.zip", "application/zip"), ("noext", None)],
)
def test_unsupported_type_is_415(client: TestClient, name: str, content_type: str | None) -> None:
    files = {"file": (name, b"\x89PNG\r\n\x1a\n data", content_type)}
    response = client.post("/v1/documents", files=files)
    assert response.status_code == 415, response.text
    assert "unsupported" in response.json()["detail"]
    assert_nothing_stored(client)


def test_wrong_request_body_type_is_415(client: TestClient) -> None:
    response = client.post("/v1/documents", content=b"hello", headers={"content-type": "text/xml"})
    assert response.status_code == 415
    assert "multipart/form-data" in response.json()["detail"]


def test_file_over_the_limit_is_413(client: TestClient) -> None:
    limit = client.app.state.prefixrag.settings.max_upload_bytes  # type: ignore[attr-defined]
    response = upload(client, "big.txt", b"a" * (limit + 1))
    assert response.status_code == 413
    assert str(limit) in response.json()["detail"]
    assert_nothing_stored(client)
    at_limit = upload(client, "exact.txt", b"word " * (limit // 5))
    assert at_limit.status_code == 201


def test_declared_content_length_over_the_limit_is_refused_before_reading(
    client: TestClient,
) -> None:
    huge = str(10**12)
    response = client.post(
        "/v1/documents",
        content=b"{}",
        headers={"content-type": "application/json", "content-length": huge},
    )
    assert response.status_code == 413
    assert huge in response.json()["detail"]


def test_streamed_body_without_content_length_is_counted(client: TestClient) -> None:
    limit = client.app.state.prefixrag.settings.max_upload_bytes  # type: ignore[attr-defined]

    def body():  # a generator makes httpx send it chunked, with no Content-Length
        for _ in range(limit // 1024 + 2048):
            yield b"x" * 1024

    response = client.post(
        "/v1/documents", content=body(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert_nothing_stored(client)


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("empty.txt", b"", "empty"),
        ("blank.txt", b"   \n\n\t  ", "no text"),
        ("broken.pdf", b"%PDF-1.4\nthis is not really a pdf", "cannot read"),
        ("empty.html", b"<html><body><script>x=1</script></body></html>", "no text"),
    ],
)
def test_unusable_content_is_422(client: TestClient, name: str, data: bytes, words: str) -> None:
    response = upload(client, name, data)
    assert response.status_code == 422, response.text
    assert words in response.json()["detail"].lower()
    assert_nothing_stored(client)


@pytest.mark.parametrize("metadata", ["[1, 2]", '"text"', "42", "{not json"])
def test_metadata_not_a_json_object_is_422(client: TestClient, metadata: str) -> None:
    response = upload(client, "a.txt", PLAIN_TEXT.encode(), metadata=metadata)
    assert response.status_code == 422
    assert "metadata" in response.json()["detail"]
    assert_nothing_stored(client)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text": "   "}, "text"),
        ({"title": "no text"}, "text"),
        ({"text": "fine", "metadata": [1]}, "metadata must be a json object"),
        ({"text": "fine", "collection": "bad name!"}, "collection"),
    ],
)
def test_bad_json_body_is_422(client: TestClient, body: dict[str, object], words: str) -> None:
    response = client.post("/v1/documents", json=body)
    assert response.status_code == 422
    assert words in response.json()["detail"].lower()
    assert_nothing_stored(client)


def test_multipart_without_a_file_is_422(client: TestClient) -> None:
    response = client.post("/v1/documents", data={"title": "x"}, files={"other": ("a", b"b")})
    assert response.status_code == 422
    assert "'file'" in response.json()["detail"]


def test_json_routes_have_their_own_smaller_body_limit(client: TestClient) -> None:
    limit = client.app.state.prefixrag.settings.max_request_bytes  # type: ignore[attr-defined]
    big_query = {"query": "x" * (limit + 10)}
    response = client.post("/v1/search", json=big_query)
    assert response.status_code == 413
    assert str(limit) in response.json()["detail"]

    def body():  # chunked: counted as it arrives, cut off at the limit
        yield b'{"query": "'
        for _ in range(limit // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    chunked = client.post(
        "/v1/search", content=body(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413
    assert "too large" in chunked.json()["detail"]
    assert client.post("/v1/search", json={"query": "small"}).status_code == 200
    declared = client.post(
        "/v1/chat/completions",
        content=b"{}",
        headers={"content-type": "application/json", "content-length": str(limit + 1)},
    )
    assert declared.status_code == 413
    assert "too large" in declared.json()["error"]["message"]  # OpenAI's shape on its routes


def test_unparseable_body_is_400_in_each_routes_error_shape(client: TestClient) -> None:
    not_utf8 = {"content": b"\xff\xfe{", "headers": {"content-type": "application/json"}}
    ours = client.post("/v1/search", **not_utf8)
    assert ours.status_code == 400
    assert ours.json()["detail"].strip()
    openai_style = client.post("/v1/completions", **not_utf8)
    assert openai_style.status_code == 400
    assert openai_style.json()["error"]["message"].strip()


def test_chunked_body_over_the_limit_on_an_openai_path_is_413_in_its_envelope(
    client: TestClient,
) -> None:
    limit = client.app.state.prefixrag.settings.max_request_bytes  # type: ignore[attr-defined]

    def body():
        yield b'{"model": "m", "prompt": "'
        for _ in range(limit // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = client.post(
        "/v1/completions", content=body(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert "too large" in response.json()["error"]["message"]


def test_openapi_documents_the_error_answers_routes_give(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]

    def schema_of(path: str, method: str, code: str, media: str = "application/json") -> dict:
        return paths[path][method]["responses"][code]["content"][media]["schema"]

    missing = client.get("/v1/documents/123456")
    assert missing.status_code == 404
    documented = schema_of("/v1/documents/{document_id}", "get", "404")
    assert documented == {"$ref": "#/components/schemas/ErrorOut"}
    assert set(missing.json()) == {"detail"}
    assert schema_of("/v1/query", "post", "422") == {"$ref": "#/components/schemas/InvalidInputOut"}
    openai_422 = schema_of("/v1/completions", "post", "422")
    assert openai_422 == {"$ref": "#/components/schemas/OpenAIErrorOut"}
    assert "text/event-stream" in paths["/v1/query"]["post"]["responses"]["200"]["content"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
