"""POST /v1/search: relevant chunks first, with offsets, pages and headings, filtered in-index."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from prefixrag.retrieval.embedder import Embedder
from tests.app.conftest import DATABASES, app_state, fresh_database, make_settings, started
from tests.app.helpers import HTML, MARKDOWN, PLAIN_TEXT, make_pdf, upload


def search(client: TestClient, query: str, **params: object) -> list[dict]:
    response = client.post("/v1/search", json={"query": query, **params})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body["timings"]) == {"embed_ms", "search_ms", "rerank_ms"}
    return body["results"]


@pytest.fixture(scope="module", params=DATABASES)
def search_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, embedder: Embedder
) -> Iterator[tuple[TestClient, dict[str, int]]]:
    """One loaded app and corpus per database, shared by this module's read-only tests.

    Dense mode, whose scores are cosines; test_hybrid_search.py covers the hybrid default.
    """
    tmp_path = tmp_path_factory.mktemp("search")
    for url in fresh_database(request.param, tmp_path):
        settings = make_settings(tmp_path, url).model_copy(update={"retrieval_mode": "dense"})
        with started(settings, embedder) as test_client:
            yield test_client, _ingest_corpus(test_client)


@pytest.fixture
def client(search_app: tuple[TestClient, dict[str, int]]) -> TestClient:
    return search_app[0]


@pytest.fixture
def corpus(search_app: tuple[TestClient, dict[str, int]]) -> dict[str, int]:
    return search_app[1]


def _ingest_corpus(client: TestClient) -> dict[str, int]:
    # Each page is longer than a chunk, so a page's middle lies in a chunk that starts there.
    pdf = make_pdf(
        [
            "Bread needs flour, water, salt and yeast, kneaded and left to rise.\n\n"
            "A baker shapes the dough into loaves and scores the top with a blade.\n\n"
            "The oven is heated very hot and the loaves bake until the crust is brown.",
            "The city zoo opened a new savanna enclosure with a wide sandy paddock, "
            "a shallow pond, shaded shelters and a raised wooden walkway for visitors.\n\n"
            "The giraffe is the tallest animal and eats leaves from acacia trees.\n\n"
            "Keepers weigh every animal once a month and record the numbers carefully.",
        ]
    )
    docs = {
        "txt": upload(client, "lighthouse.txt", PLAIN_TEXT.encode()),
        "md": upload(client, "garden.md", MARKDOWN.encode(), collection="garden"),
        "html": upload(client, "volcano.html", HTML.encode()),
        "pdf": upload(client, "mixed.pdf", pdf),
    }
    assert all(r.status_code == 201 for r in docs.values())
    return {kind: r.json()["id"] for kind, r in docs.items()}


def test_finds_the_right_chunk_with_offsets_into_the_text(
    client: TestClient, corpus: dict[str, int]
) -> None:
    hits = search(client, "ships avoid the rocky coast in storms", top_k=3)
    best = hits[0]
    assert best["document_id"] == corpus["txt"]
    assert "rocky coast" in best["text"]
    # For plain text the extracted text is the upload itself: an independent check of offsets.
    assert PLAIN_TEXT[best["start"] : best["end"]] == best["text"]
    assert best["title"] == "lighthouse.txt"
    assert best["page"] is None


def test_pdf_hits_carry_their_page(client: TestClient, corpus: dict[str, int]) -> None:
    best = search(client, "tallest animal eating acacia leaves")[0]
    assert best["document_id"] == corpus["pdf"]
    assert "giraffe" in best["text"]
    assert best["page"] == 2
    bread = search(client, "flour water salt yeast kneaded")[0]
    assert (bread["document_id"], bread["page"]) == (corpus["pdf"], 1)


def test_markdown_and_html_hits_carry_their_heading_path(
    client: TestClient, corpus: dict[str, int]
) -> None:
    soil = search(client, "compost and drained loam for roots")[0]
    assert soil["document_id"] == corpus["md"]
    assert soil["heading"] == "Gardening > Soil"
    assert MARKDOWN[soil["start"] : soil["end"]] == soil["text"]
    ash = search(client, "ash clouds ground aircraft")[0]
    assert ash["document_id"] == corpus["html"]
    assert ash["heading"] == "Volcanoes > Eruptions"
    assert "never indexed" not in ash["text"]


def test_scores_are_the_cosine_similarities_best_first(
    client: TestClient, corpus: dict[str, int]
) -> None:
    query = "volcanic magma in the crust"
    hits = search(client, query, top_k=4)
    embedder = app_state(client).embedder
    assert embedder is not None
    q = embedder.encode_query(query)
    expected = embedder.encode([h["text"] for h in hits]) @ q
    np.testing.assert_allclose([h["score"] for h in hits], expected, atol=1e-4)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert all(h["rerank_score"] is None for h in hits)  # no reranker loads in tests


def test_filters_apply_inside_the_search(client: TestClient, corpus: dict[str, int]) -> None:
    # Without a filter the lighthouse text wins; each filter must still fill top_k from its set.
    query = "lighthouse lamp at night"
    garden = search(client, query, collection="garden", top_k=3)
    assert len(garden) == 3
    assert {h["document_id"] for h in garden} == {corpus["md"]}
    only_pdf = search(client, query, document_ids=[corpus["pdf"]], top_k=2)
    assert len(only_pdf) == 2
    assert {h["document_id"] for h in only_pdf} == {corpus["pdf"]}
    both = search(client, query, document_ids=[corpus["pdf"], corpus["txt"]], top_k=50)
    assert {h["document_id"] for h in both} == {corpus["pdf"], corpus["txt"]}
    assert search(client, query, collection="no-such-collection") == []
    assert search(client, query, document_ids=[10_000]) == []


def test_invalid_search_requests_are_422(client: TestClient) -> None:
    for body in ({"query": ""}, {"query": "x", "top_k": 0}, {"top_k": 3}, {"query": "  "}):
        response = client.post("/v1/search", json=body)
        assert response.status_code == 422
        assert response.json()["detail"]
