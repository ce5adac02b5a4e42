"""API keys and tenants: 401 without a valid key once keys exist, and one tenant never sees
another's documents, searches or chunks (another tenant's id is 404, as if it did not exist)."""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from prefixrag.app.cli.main import main
from prefixrag.app.core.errors import InvalidInputError
from prefixrag.app.core.models import ApiKey
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.api_keys import create_key, list_keys, revoke_key
from tests.app.conftest import app_state, started

SECRET_TEXT = b"The vault combination of tenant A is written on the lighthouse logbook page nine."
OTHER_TEXT = b"Tenant B keeps notes about tomatoes, compost and aphids in the greenhouse."


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_key(client: TestClient, name: str) -> str:
    sessions = app_state(client).sessions
    assert sessions is not None
    return create_key(sessions=sessions, name=name)[1]


def test_only_the_hash_of_a_key_is_stored(client: TestClient) -> None:
    key = new_key(client, "acme")
    sessions = app_state(client).sessions
    assert sessions is not None
    with sessions() as session:
        (row,) = session.scalars(select(ApiKey)).all()
        stored = [str(getattr(row, c.key)) for c in ApiKey.__table__.columns]
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert not any(key in value for value in stored)
    assert [k.name for k in list_keys(sessions=sessions)] == ["acme"]
    with pytest.raises(InvalidInputError, match="revoke it first"):
        create_key(sessions=sessions, name="acme")


def test_open_until_a_key_exists_then_401_without_a_valid_one(client: TestClient) -> None:
    assert client.get("/v1/documents").status_code == 200  # no keys: open
    key = new_key(client, "acme")
    for headers in ({}, bearer("prk_wrong"), {"Authorization": "Basic abc"}):
        response = client.get("/v1/documents", headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        assert "key" in response.json()["detail"].lower()
    assert client.get("/v1/documents", headers=bearer(key)).status_code == 200
    for path in ("/healthz", "/readyz"):
        assert client.get(path).status_code == 200
    openai_style = client.post("/v1/chat/completions", json={"model": "x", "messages": []})
    assert openai_style.status_code == 401
    assert openai_style.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/search", json={"query": "x"}).status_code == 401
    assert client.get("/metrics").status_code == 401


def test_a_revoked_key_stops_working_at_once(client: TestClient) -> None:
    key = new_key(client, "acme")
    new_key(client, "other")  # keys still exist after the revoke: auth stays on
    assert client.get("/v1/documents", headers=bearer(key)).status_code == 200
    sessions = app_state(client).sessions
    assert sessions is not None
    revoke_key(sessions=sessions, name="acme")
    assert client.get("/v1/documents", headers=bearer(key)).status_code == 401


def test_require_auth_without_any_key_refuses_everyone(
    settings: Settings, embedder: object
) -> None:
    settings = settings.model_copy(update={"require_auth": True})
    with started(settings, embedder) as client:
        assert client.get("/v1/documents").status_code == 401
        assert client.get("/v1/documents", headers=bearer("anything")).status_code == 401
        assert client.get("/healthz").status_code == 200


def test_tenants_see_only_their_own_documents(client: TestClient) -> None:
    a, b = bearer(new_key(client, "tenant-a")), bearer(new_key(client, "tenant-b"))
    mine = client.post(
        "/v1/documents?wait=true",
        files={"file": ("secret.txt", SECRET_TEXT, "text/plain")},
        data={"collection": "notes"},
        headers=a,
    )
    assert mine.status_code == 201, mine.text
    doc_id = mine.json()["id"]
    # the same collection name, and even the same content, is each tenant's own
    theirs = client.post(
        "/v1/documents?wait=true",
        files={"file": ("notes.txt", OTHER_TEXT, "text/plain")},
        data={"collection": "notes"},
        headers=b,
    )
    assert theirs.status_code == 201, theirs.text
    same = client.post(
        "/v1/documents?wait=true",
        files={"file": ("copy.txt", SECRET_TEXT, "text/plain")},
        data={"collection": "notes"},
        headers=b,
    )
    assert same.status_code == 201, same.text  # not a 409 that would reveal A's upload

    listed = client.get("/v1/documents", headers=b).json()
    assert {d["id"] for d in listed["items"]} == {theirs.json()["id"], same.json()["id"]}
    assert listed["total"] == 2
    assert client.get(f"/v1/documents/{doc_id}", headers=b).status_code == 404
    assert client.delete(f"/v1/documents/{doc_id}", headers=b).status_code == 404
    assert client.get(f"/v1/documents/{doc_id}", headers=a).json()["status"] == "ready"

    query = {"query": "vault combination lighthouse logbook", "top_k": 10}
    b_hits = client.post("/v1/search", json=query, headers=b).json()["results"]
    assert b_hits and doc_id not in {h["document_id"] for h in b_hits}
    pinned = client.post("/v1/search", json={**query, "document_ids": [doc_id]}, headers=b)
    assert pinned.json()["results"] == []
    a_hits = client.post("/v1/search", json=query, headers=a).json()["results"]
    assert {h["document_id"] for h in a_hits} == {doc_id}


def test_keys_cli_creates_lists_and_revokes(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "create", "--name", "ops"], settings) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("prk_") and len(key) > 40
    assert main(["keys", "list"], settings) == 0
    listing = capsys.readouterr().out
    assert "ops" in listing and key[:12] in listing and key not in listing
    assert main(["keys", "create", "--name", "ops"], settings) == 2  # one active key per name
    capsys.readouterr()
    assert main(["keys", "revoke", "ops"], settings) == 0
    assert main(["keys", "list"], settings) == 0
    assert "no keys" in capsys.readouterr().out
