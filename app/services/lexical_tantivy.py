"""Hybrid mode's BM25 through a tantivy index (settings.lexical_engine = "tantivy").

The service's side of retrieval/tantivy_lexical.py: it analyzes the query with the analyzer that
wrote the terms, and turns a ChunkScope (tenant, collection name, documents) into the index's
own filter terms. A tenant or collection becomes the ids of the collections it names: a read
of the small collections table, so renaming a collection never leaves the index behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import Collection
from prefixrag.app.services.lexical import ChunkScope
from prefixrag.retrieval.analyzer import Analyzer
from prefixrag.retrieval.lexical import index_terms
from prefixrag.retrieval.tantivy_lexical import TantivyLexical


class TantivyLexicalIndex:
    """BM25 over every ready chunk's terms in `store` (a retrieval.lexical.LexicalSearch).

    Ingest adds a document's chunks beside their vectors, and deletes remove them the same way
    (app/services/ingest.py); the start-up check repairs what a crash left between the two
    (app/services/index_sync.py's reconcile_lexical)."""

    def __init__(
        self, sessions: sessionmaker[Session], store: TantivyLexical, analyzer: Analyzer
    ) -> None:
        self._sessions = sessions
        self.store = store
        self.analyzer = analyzer

    def search(
        self, query: str, k: int, scope: ChunkScope | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks within `scope` (None = every chunk) that share
        a term with `query`, best first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = index_terms(self.analyzer, query)
        scope = scope if scope is not None else ChunkScope()
        collection_ids = self._collection_ids(scope)
        return self.store.search(
            terms, k, collection_ids=collection_ids, document_ids=scope.document_ids
        )

    def add(
        self,
        chunk_ids: np.ndarray | Sequence[int],
        texts: Sequence[str],
        *,
        document_id: int,
        collection_id: int,
    ) -> None:
        """Index one document's chunks; `texts` are what BM25 indexes of each
        (retrieval.lexical.searchable_text)."""
        terms = [index_terms(self.analyzer, t) for t in texts]
        num = len(terms)
        self.store.add(
            chunk_ids, terms, document_ids=[document_id] * num, collection_ids=[collection_id] * num
        )

    def remove(self, chunk_ids: np.ndarray | Sequence[int]) -> None:
        """Drop these chunks."""
        self.store.remove(chunk_ids)

    def ids(self) -> np.ndarray:
        """Every chunk id held, sorted."""
        return self.store.ids()

    def _collection_ids(self, scope: ChunkScope) -> list[int] | None:
        if scope.tenant is None and scope.collection is None:
            return None
        query = select(Collection.id)
        if scope.tenant is not None:
            query = query.where(Collection.tenant == scope.tenant)
        if scope.collection is not None:
            query = query.where(Collection.name == scope.collection)
        with self._sessions() as session:
            return [int(i) for i in session.scalars(query)]
