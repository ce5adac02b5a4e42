"""With a loadable cross-encoder, search reorders the candidates by its scores."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.reranker import Reranker
from tests.app.conftest import make_settings, started
from tests.retrieval.tiny_cross_encoder import KEYWORD, WORDS, build_tiny_cross_encoder


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(packaged_embedder_path(), tmp_path_factory.mktemp("ce"))


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """Reranking does not touch the database beyond what other tests cover: SQLite only."""
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.mark.slow  # trains a small cross-encoder first (about a minute on two shared cores)
def test_search_orders_by_the_cross_encoder(
    tmp_path: Path, database_url: str, embedder: Embedder, cross_encoder_dir: Path
) -> None:
    settings = make_settings(tmp_path, database_url)
    settings.rerank_model = str(cross_encoder_dir)
    rng = random.Random(7)
    others = [w for w in WORDS if w != KEYWORD]
    passages = [" ".join(rng.sample(others, 6)) for _ in range(8)]
    passages += [" ".join([*rng.sample(others, 5), KEYWORD]) for _ in range(2)]
    query = f"where is the {KEYWORD}"
    with started(settings, embedder) as client:
        assert client.get("/readyz").json()["components"]["reranker"] == "ok"
        for i, text in enumerate(passages):
            response = client.post("/v1/documents?wait=true", json={"text": text, "title": f"p{i}"})
            assert response.status_code == 201
        body = client.post("/v1/search", json={"query": query, "top_k": 4, "candidates": 10})
        hits = body.json()["results"]
    assert len(hits) == 4
    rerank = [h["rerank_score"] for h in hits]
    assert rerank == sorted(rerank, reverse=True)
    # An independent load of the same model scores every passage; the top 4 must match.
    reference = Reranker(str(cross_encoder_dir)).score(query, passages)
    assert reference is not None
    expected = [passages[i] for i in np.argsort(-reference)[:4]]
    assert [h["text"] for h in hits] == expected
    np.testing.assert_allclose(rerank, np.sort(reference)[::-1][:4], atol=1e-4)
    assert {KEYWORD in h["text"] for h in hits[:2]} == {True}
