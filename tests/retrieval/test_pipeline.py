"""Retriever end to end on the packaged embedder, a real index and the tiny cross-encoder."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.lexical.fts5_index import Fts5Index
from prefixrag.retrieval.pipeline import Retriever, TextPassage
from prefixrag.retrieval.reranker import Reranker
from prefixrag.retrieval.vector_index import VectorIndex
from tests.retrieval.tiny_cross_encoder import toy_pair


@pytest.fixture(scope="module")
def corpus() -> dict[int, str]:
    rng = random.Random(3)
    return {1000 + n: toy_pair(rng)[1] for n in range(40)}


@pytest.fixture(scope="module")
def index(embedder: Embedder, corpus: dict[int, str]) -> VectorIndex:
    index = VectorIndex(embedder.dim, use_gpu="no")
    ids = np.array(list(corpus), dtype=np.int64)
    index.add(ids, embedder.encode(list(corpus.values())))
    return index


@pytest.fixture(scope="module")
def lexical(corpus: dict[int, str]) -> Fts5Index:
    lexical = Fts5Index()
    lexical.add(np.array(list(corpus), dtype=np.int64), list(corpus.values()))
    return lexical


def fetcher(corpus: dict[int, str], calls: list[list[int]] | None = None):
    def fetch(ids: list[int]) -> dict[int, TextPassage]:
        if calls is not None:
            calls.append(list(ids))
        return {i: TextPassage(corpus[i]) for i in ids if i in corpus}

    return fetch


@pytest.mark.parametrize("reranking", [False, True])
def test_passages_load_once_and_travel_with_their_hits(
    embedder: Embedder,
    index: VectorIndex,
    corpus: dict[int, str],
    tiny_cross_encoder: Path,
    reranking: bool,
) -> None:
    reranker = Reranker(str(tiny_cross_encoder), device="cpu") if reranking else None
    retriever = Retriever(embedder, index, reranker)
    calls: list[list[int]] = []
    result = retriever.retrieve(
        "where is the lemon",
        top_k=3,
        candidates=12,
        allowed_ids=None,
        load_passages=fetcher(corpus, calls),
    )
    # one load: every candidate when the reranker reads them, else only the top_k
    assert len(calls) == 1 and len(calls[0]) == (12 if reranking else 3)
    assert [h.passage.text for h in result.hits] == [corpus[h.chunk_id] for h in result.hits]


def test_reranked_order_follows_rerank_scores(
    embedder: Embedder, index: VectorIndex, corpus: dict[int, str], tiny_cross_encoder: Path
) -> None:
    reranker = Reranker(str(tiny_cross_encoder), device="cpu")
    retriever = Retriever(embedder, index, reranker)
    query = "where is the lemon"
    result = retriever.retrieve(
        query, top_k=5, candidates=40, allowed_ids=None, load_passages=fetcher(corpus)
    )
    assert len(result.hits) == 5
    assert set(result.timings) == {"embed_ms", "search_ms", "rerank_ms"}
    # reference: score every candidate with the cross-encoder directly. Batches pad differently,
    # so scores agree to float32 noise, not bit for bit: near-ties may swap, nothing more.
    all_ids = list(corpus)
    direct = dict(zip(all_ids, reranker.score(query, [corpus[i] for i in all_ids]), strict=True))
    noise = 1e-3
    for hit in result.hits:
        assert abs(hit.rerank_score - direct[hit.chunk_id]) < noise
    kept = {h.chunk_id for h in result.hits}
    weakest_kept = min(direct[i] for i in kept)
    assert all(direct[i] < weakest_kept + noise for i in all_ids if i not in kept)
    assert all("lemon" in corpus[h.chunk_id] for h in result.hits)
    assert [h.rerank_score for h in result.hits] == sorted(
        (h.rerank_score for h in result.hits), reverse=True
    )


def test_first_stage_order_without_reranker(
    embedder: Embedder, index: VectorIndex, corpus: dict[int, str]
) -> None:
    unavailable = Reranker("not/a-cached-model")
    for reranker in (None, unavailable):
        retriever = Retriever(embedder, index, reranker)
        result = retriever.retrieve(
            "piano", top_k=4, candidates=10, allowed_ids=None, load_passages=fetcher(corpus)
        )
        scores, ids = index.search(embedder.encode_query("piano"), 4)
        assert [h.chunk_id for h in result.hits] == ids[0].tolist()
        assert all(h.rerank_score is None for h in result.hits)
        np.testing.assert_allclose([h.score for h in result.hits], scores[0], rtol=1e-6)


@pytest.mark.parametrize("hybrid", [False, True])
def test_allowed_ids_are_respected(
    embedder: Embedder,
    index: VectorIndex,
    corpus: dict[int, str],
    tiny_cross_encoder: Path,
    lexical: Fts5Index,
    hybrid: bool,
) -> None:
    allowed = np.array(list(corpus)[::5], dtype=np.int64)
    reranker = Reranker(str(tiny_cross_encoder))
    retriever = Retriever(embedder, index, reranker, lexical=lexical if hybrid else None)
    result = retriever.retrieve(
        "where is the lemon",
        top_k=3,
        candidates=20,
        allowed_ids=allowed,
        load_passages=fetcher(corpus),
    )
    assert len(result.hits) == 3
    assert set(h.chunk_id for h in result.hits) <= set(allowed.tolist())


@pytest.mark.parametrize("weight,rrf_k", [(1.0, 60.0), (3.0, 5.0), (0.0, 60.0)])
def test_hybrid_fuses_dense_and_bm25_over_the_allowed_corpus(
    embedder: Embedder,
    index: VectorIndex,
    corpus: dict[int, str],
    lexical: Fts5Index,
    weight: float,
    rrf_k: float,
) -> None:
    allowed = np.array(list(corpus)[1::2], dtype=np.int64)
    retriever = Retriever(
        embedder, index, None, lexical=lexical, lexical_weight=weight, rrf_k=rrf_k
    )
    query = "the lemon is on the table"
    result = retriever.retrieve(
        query, top_k=6, candidates=8, allowed_ids=allowed, load_passages=fetcher(corpus)
    )
    # reference: rank the allowed chunks by each list and sum weight / (k + rank) by hand
    _, dense_ids = index.search(embedder.encode_query(query), 8, allowed)
    _, bm25_ids = lexical.search(query, 8, allowed)
    fused: dict[int, float] = {}
    for ids, w in ((dense_ids[0].tolist(), 1.0), (bm25_ids.tolist(), weight)):
        for rank, chunk_id in enumerate(ids):
            fused[chunk_id] = fused.get(chunk_id, 0.0) + w / (rrf_k + rank + 1)
    got = {h.chunk_id: h.score for h in result.hits}
    assert got == pytest.approx({i: fused[i] for i in got})
    assert sorted(fused.values(), reverse=True)[:6] == pytest.approx(list(got.values()))
    assert set(got) <= set(allowed.tolist())


def test_texts_missing_from_fetch_are_dropped(
    embedder: Embedder, index: VectorIndex, corpus: dict[int, str], tiny_cross_encoder: Path
) -> None:
    deleted = set(list(corpus)[:20])
    partial = {i: t for i, t in corpus.items() if i not in deleted}
    retriever = Retriever(embedder, index, Reranker(str(tiny_cross_encoder)))
    result = retriever.retrieve(
        "lemon", top_k=10, candidates=40, allowed_ids=None, load_passages=fetcher(partial)
    )
    assert result.hits and not deleted & {h.chunk_id for h in result.hits}


def test_bad_parameters(embedder: Embedder, index: VectorIndex) -> None:
    retriever = Retriever(embedder, index, None)
    with pytest.raises(ValueError):
        retriever.retrieve("q", top_k=0, candidates=5, allowed_ids=None, load_passages=dict)
    with pytest.raises(ValueError):
        retriever.retrieve("q", top_k=6, candidates=5, allowed_ids=None, load_passages=dict)
    with pytest.raises(ValueError):
        Retriever(embedder, VectorIndex(8, use_gpu="no"), None)
