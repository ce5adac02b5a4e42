"""Retrieve: embed the query, FAISS (and BM25) top candidates, fuse, rerank, keep top_k."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.fusion import RRF_K, rrf_scores
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.lexical.terms import LexicalSearch
from prefixrag.retrieval.reranker import Reranker
from prefixrag.retrieval.vector_index import VectorIndex


class Passage(Protocol):
    """What the caller's store hands back for a chunk id: anything with the chunk's text."""

    @property
    def text(self) -> str: ...


@dataclass(slots=True, frozen=True)
class TextPassage:
    """A passage that is only its text (benchmarks and callers with no store of their own)."""

    text: str


P = TypeVar("P", bound=Passage)
PassageLoader = Callable[[list[int]], Mapping[int, P]]


@dataclass(slots=True)
class Hit(Generic[P]):
    """A retrieved chunk: the caller's passage for it (its text and whatever else the store
    keeps), its first-stage (vector or fused) score, and its rerank score if any."""

    chunk_id: int
    score: float
    rerank_score: float | None
    passage: P


@dataclass(slots=True)
class RetrievalResult(Generic[P]):
    """Hits, best first, how long each stage took (embed_ms, search_ms, rerank_ms), and the
    query's embedding (for callers that score more text against the same query)."""

    hits: list[Hit[P]]
    timings: dict[str, float] = field(default_factory=dict)
    query_vector: np.ndarray | None = None


class Retriever:
    """The ask-path retrieval: dense search, optional BM25 fusion, optional cross-encoder rerank.

    With a `lexical` store (hybrid mode), the `candidates` best chunks by vector and the
    `candidates` best by BM25, both over the whole allowed corpus, are merged by weighted
    reciprocal-rank fusion (BM25's weight `lexical_weight`, the vector's 1); the fused score is
    each hit's `score`. bench/retrieval_eval.py measures the modes. Without a usable reranker,
    hits keep the first-stage order.
    """

    def __init__(
        self,
        embedder: Embedder,
        index: VectorIndex,
        reranker: Reranker | None,
        *,
        lexical: LexicalSearch | None = None,
        lexical_weight: float = 1.0,
        rrf_k: float = RRF_K,
    ) -> None:
        if embedder.dim != index.dim:
            raise ValueError(f"embedder dim {embedder.dim} != index dim {index.dim}")
        if not lexical_weight >= 0 or not rrf_k >= 0:
            raise ValueError(f"lexical_weight and rrf_k must be >= 0: {lexical_weight}, {rrf_k}")
        self.embedder = embedder
        self.index = index
        self.reranker = reranker
        self.lexical = lexical
        self.lexical_weight = lexical_weight
        self.rrf_k = rrf_k

    @property
    def is_hybrid(self) -> bool:
        """True when BM25 candidates are fused with the vector candidates."""
        return self.lexical is not None

    @property
    def is_reranking(self) -> bool:
        """True when a loaded cross-encoder reorders the candidates."""
        return self.reranker is not None and self.reranker.is_available

    def retrieve(
        self,
        query: str,
        *,
        top_k: int,
        candidates: int,
        allowed_ids: np.ndarray | IdBitmap | None,
        load_passages: PassageLoader[P],
        lexical_scope: Any = None,
    ) -> RetrievalResult[P]:
        """The top_k chunks for `query` among `allowed_ids` (None = all), best first.

        `lexical_scope` is the same filter in the lexical store's own terms (it filters inside
        its query); it must allow exactly the chunks `allowed_ids` allows. When None, the store
        gets `allowed_ids` (stores scoped by ids, such as Fts5Index), so no filter is dropped.

        `load_passages` maps chunk ids to the caller's passages; it is called once: for every
        candidate when a reranker reads their texts, else for the first top_k. Ids it doesn't
        return are dropped (deleted meanwhile, say).
        """
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if candidates < top_k:
            raise ValueError(f"candidates ({candidates}) must be >= top_k ({top_k})")
        timings: dict[str, float] = {}
        # embed
        t0 = time.perf_counter()
        query_vector = self.embedder.encode_query(query)
        timings["embed_ms"] = _ms_since(t0)
        # search
        t0 = time.perf_counter()
        scores, ids = self.index.search(query_vector, candidates, allowed_ids)
        found = ids[0] >= 0
        ranked = [(int(i), float(s)) for i, s in zip(ids[0][found], scores[0][found], strict=True)]
        if self.lexical is not None:
            scope = lexical_scope if lexical_scope is not None else allowed_ids
            ranked = self._fuse(query, ranked, self.lexical, candidates, scope)
        timings["search_ms"] = _ms_since(t0)
        # rerank
        t0 = time.perf_counter()
        if not self.is_reranking:
            ranked = ranked[:top_k]
        passages = load_passages([chunk_id for chunk_id, _ in ranked]) if ranked else {}
        hits = [Hit(i, score, None, passages[i]) for i, score in ranked if i in passages]
        if hits and self.is_reranking:
            hits = self._rerank(query, hits)
        timings["rerank_ms"] = _ms_since(t0)
        return RetrievalResult(hits[:top_k], timings, query_vector)

    def _fuse(
        self,
        query: str,
        dense: list[tuple[int, float]],
        lexical: LexicalSearch,
        candidates: int,
        scope: Any,
    ) -> list[tuple[int, float]]:
        _, lexical_ids = lexical.search(query, candidates, scope)
        dense_ids = [chunk_id for chunk_id, _ in dense]
        fused = rrf_scores(
            [dense_ids, lexical_ids.tolist()], [1.0, self.lexical_weight], self.rrf_k
        )
        # ties keep dense order first, then BM25 order (dicts keep insertion order)
        order = sorted(enumerate(fused), key=lambda item: (-fused[item[1]], item[0]))
        return [(chunk_id, fused[chunk_id]) for _, chunk_id in order[:candidates]]

    def _rerank(self, query: str, hits: list[Hit[P]]) -> list[Hit[P]]:
        texts = [hit.passage.text for hit in hits]
        rerank_scores = self.reranker.score(query, texts) if self.reranker is not None else None
        if rerank_scores is None:
            return hits
        order = np.argsort(-rerank_scores, kind="stable")
        for hit, score in zip(hits, rerank_scores, strict=True):
            hit.rerank_score = float(score)
        return [hits[i] for i in order]


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0
