"""Tenants and the prefix cache, on a live server with the LLM: a tenant's blocks are salted with
its own namespace, so another tenant sending the exact same prompt reuses at most the public
system prefix, never a cache hit that would tell it what the first tenant asked. Also the
generation queue limit: 429 with Retry-After, and the slot comes back when a stream ends."""

from __future__ import annotations

import httpx
import pytest

from prefixrag.app.main import create_app
from prefixrag.app.services.api_keys import create_key
from tests.app.conftest import LOAD_TIMEOUT_S
from tests.app.live_server import live_server
from tests.app.qa_helpers import ingest_docs, qa_settings

QUESTION = "What do ships use the lighthouse beam for?"
PROMPT = " ".join(f"Line {i}: the keeper logged a ship passing the rocky coast." for i in range(12))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    """A live server with two keys (one generation at a time); yields an httpx client per
    tenant (both with the same documents), and the app state."""
    settings = qa_settings(tmp_path_factory.mktemp("tenant-cache"), request, max_queued_requests=1)
    app = create_app(settings, embedder=embedder)
    with live_server(app, LOAD_TIMEOUT_S) as base:
        state = app.state.prefixrag
        clients = []
        for name in ("tenant-a", "tenant-b"):
            _, key = create_key(sessions=state.sessions, name=name)
            headers = {"Authorization": f"Bearer {key}"}
            client = httpx.Client(base_url=base, timeout=LOAD_TIMEOUT_S, headers=headers)
            ingest_docs(client)
            clients.append(client)
        yield clients[0], clients[1], state
        for client in clients:
            client.close()


def complete(client: httpx.Client) -> dict:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def ask(client: httpx.Client) -> dict:
    response = client.post("/v1/query", json={"question": QUESTION, "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_a_raw_prompt_is_never_a_hit_for_another_tenant(tenants):
    a, b, _ = tenants
    first = complete(a)
    again = complete(a)
    other = complete(b)
    assert first["prompt_tokens"] == again["prompt_tokens"] == other["prompt_tokens"] > 64
    assert again["prompt_tokens_details"]["cached_tokens"] > 0  # the cache does work for A
    assert other["prompt_tokens_details"]["cached_tokens"] == 0  # but never across tenants


def test_the_same_question_shares_only_the_public_system_prefix(tenants):
    a, b, state = tenants
    block_size = state.settings.block_size
    public = len(state.prompts.stable_ids) // block_size * block_size
    assert public > 0
    first = ask(a)
    again = ask(a)
    other = ask(b)
    assert first["prompt_tokens"] == other["prompt_tokens"]  # the same prompt, token for token
    assert again["cached_tokens"] > public  # A reuses its own sources
    assert other["cached_tokens"] == public  # B: the system prompt only
    assert other["blended_tokens"] == other["recomputed_tokens"] == 0  # nor A's source bodies


def test_a_full_generation_queue_answers_429_with_retry_after(tenants):
    a, b, _ = tenants
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,  # no early end: the stream must outlive the requests below
        "stream": True,
    }
    with a.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # keep a reference: a collected iterator closes the stream
        first = next(lines)  # the generation is running: the one slot is taken
        assert first.startswith("data:")
        refused = b.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert "retry" in refused.json()["error"]["message"]
        asked = b.post("/v1/query", json={"question": QUESTION, "max_tokens": 1})
        assert asked.status_code == 429 and "retry-after" in asked.headers
    # the stream is closed: its slot is free again
    assert complete(b)["completion_tokens"] == 1


def test_another_tenants_chunk_ids_in_history_are_not_found(tenants):
    a, b, _ = tenants
    answer = a.post("/v1/query", json={"question": QUESTION, "max_tokens": 2}).json()
    history = [{"question": QUESTION, "answer": answer["answer"], "chunk_ids": answer["chunk_ids"]}]
    body = {"question": "And in the morning?", "max_tokens": 2, "history": history}
    assert answer["chunk_ids"]
    assert a.post("/v1/query", json=body).status_code == 200
    stolen = b.post("/v1/query", json=body)
    assert stolen.status_code == 404
    assert "no longer exists" in stolen.json()["detail"]


def test_known_sources_are_reused_at_new_positions_until_their_document_goes(tenants):
    a, _, state = tenants
    docs = {d["title"]: d["id"] for d in a.get("/v1/documents").json()["items"]}
    ids = sorted(docs.values())
    assert len(ids) >= 3

    def ask_over(document_ids: list[int]) -> dict:
        body = {"question": QUESTION, "max_tokens": 2, "document_ids": document_ids}
        response = a.post("/v1/query", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    ask_over(ids[1:3])  # lays out the second and third documents' chunks
    # the third document's chunks now follow the first's: a new position, reused by blending
    moved = ask_over([ids[0], ids[2]])
    usage = moved["usage"]
    third = [c for c in moved["citations"] if c["document_id"] == ids[2]]
    assert third and usage["blended_tokens"] + usage["recomputed_tokens"] > 0
    engine = state.llm.engine.engine
    tag = f"doc:{ids[2]}"
    assert any(tag in entry.tags for entry in engine.scheduler.chunks.entries())
    assert a.delete(f"/v1/documents/{ids[2]}").status_code == 204
    assert not any(tag in entry.tags for entry in engine.scheduler.chunks.entries())
    again = ask_over([ids[0], ids[1]])
    assert all(c["document_id"] != ids[2] for c in again["citations"])
