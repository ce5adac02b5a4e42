"""GET /metrics: the named series exist and move after a query (parsed by prometheus_client)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from prefixrag.app.core.models import Chunk
from prefixrag.app.main import create_app
from tests.app.conftest import LOAD_TIMEOUT_S, app_state, make_settings
from tests.app.qa_helpers import DOCS, ingest_docs, qa_settings


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(tmp_path_factory.mktemp("metrics-data"), request)
    with TestClient(create_app(settings, embedder=embedder)) as test_client:
        if not app_state(test_client).wait_loaded(LOAD_TIMEOUT_S):
            raise TimeoutError("the app did not finish loading")
        ingest_docs(test_client)
        yield test_client


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_series_move_after_a_query(client: TestClient):
    before = scrape(client)
    body = {"question": "What grounds aircraft?", "max_tokens": 6, "temperature": 0}
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200
    out = response.json()
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    query = {"route": "/v1/query", "method": "POST"}
    assert delta("prefixrag_http_requests_total", status="200", **query) == 1
    assert delta("prefixrag_http_request_duration_seconds_count", **query) == 1
    assert delta("prefixrag_http_request_duration_seconds_sum", **query) > 0
    assert delta("prefixrag_ttft_seconds_count") == 1
    assert delta("prefixrag_ttft_seconds_sum") == pytest.approx(out["timings"]["ttft_ms"] / 1000)
    assert delta("prefixrag_tpot_seconds_count") == (out["usage"]["completion_tokens"] > 1)
    for stage in ("embed", "search", "rerank"):
        assert delta(f"prefixrag_{stage}_seconds_count") == 1
    assert delta("prefixrag_prefix_cache_queried_tokens_total") >= out["usage"]["prompt_tokens"]
    assert delta("prefixrag_prefix_cache_hit_tokens_total") >= out["usage"]["cached_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_plain_openai_calls_feed_the_generation_series(client: TestClient, stream: bool):
    model = client.get("/v1/models").json()["data"][0]["id"]
    before = scrape(client)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 3,
        "stream": stream,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    after = scrape(client)
    for name in ("prefixrag_ttft_seconds_count", "prefixrag_ttft_seconds_sum"):
        assert value(after, name) > value(before, name)


def test_cache_and_block_series_match_the_engine(client: TestClient):
    samples = scrape(client)
    stats = app_state(client).llm.engine.stats()  # type: ignore[union-attr]
    # no request runs between these two reads, so the numbers must agree
    assert value(samples, "prefixrag_prefix_cache_hit_tokens_total") == stats["hit_tokens"]
    assert value(samples, "prefixrag_prefix_cache_queried_tokens_total") == stats["queried_tokens"]
    for state in ("used", "free", "pinned", "cached"):
        assert value(samples, "prefixrag_kv_blocks", state=state) == stats[f"blocks_{state}"]
    assert value(samples, "prefixrag_kv_blocks", state="pinned") > 0


def test_chunk_store_series_match_the_engine(client: TestClient):
    # a question lays out source bodies, which the chunk store keeps for later questions
    out = client.post("/v1/query", json={"question": "What guides ships?", "max_tokens": 2})
    assert out.status_code == 200
    samples = scrape(client)
    stats = app_state(client).llm.engine.stats()  # type: ignore[union-attr]
    assert stats["chunk_entries"] > 0
    assert value(samples, "prefixrag_chunk_store_entries", tier="pool") == stats["chunk_entries"]
    held = value(samples, "prefixrag_chunk_store_bytes", tier="pool")
    assert held == stats["chunk_pool_bytes"] > 0
    assert (
        value(samples, "prefixrag_chunk_store_lookups_total", result="hit_pool")
        == stats["chunk_hits"]
    )
    assert (
        value(samples, "prefixrag_chunk_store_evictions_total", tier="pool")
        == stats["chunk_evictions"]
    )
    blended = value(samples, "prefixrag_chunk_reuse_tokens_total", kind="blended")
    assert blended == stats["blended_tokens"]


def test_documents_and_chunks_by_status_come_from_the_database(client: TestClient):
    sessions = app_state(client).sessions
    assert sessions is not None
    with sessions() as session:
        num_chunks = session.scalar(select(func.count(Chunk.id)))
    samples = scrape(client)
    assert value(samples, "prefixrag_documents", status="ready") == len(DOCS)
    assert value(samples, "prefixrag_chunks", status="ready") == num_chunks > 0


def test_unknown_paths_share_one_route_label(client: TestClient):
    before = scrape(client)
    client.get("/no/such/path/1")
    client.get("/no/such/path/2")
    after = scrape(client)
    labels = {"route": "unmatched", "method": "GET", "status": "404"}
    assert (
        value(after, "prefixrag_http_requests_total", **labels)
        - value(before, "prefixrag_http_requests_total", **labels)
        == 2
    )
    assert not any("/no/such" in str(key) for key in after)


def test_each_app_has_its_own_registry(client: TestClient, tmp_path):
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'other.db'}")
    metrics = create_app(settings).state.prefixrag.metrics
    assert metrics is not None and metrics is not app_state(client).metrics
    assert b"/v1/query" not in metrics.render()
