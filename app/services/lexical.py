"""BM25 search inside the database, over the chunk terms that ingest writes (app/core/lexical.py).

Both databases rank by the same formula, FTS5's bm25() (k1=1.2, b=0.75):
    score(q, d) = sum over query terms t in d (once per occurrence in the query) of
        idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * len(d) / avg_len))
    idf(t) = max(ln((N - df(t) + 0.5) / (df(t) + 0.5)), 1e-6)
with N, df and avg_len over every chunk stored (all tenants, as one index), len(d) in terms.

- SQLite computes it: FTS5's own bm25().
- PostgreSQL has no BM25 (ts_rank and ts_rank_cd ignore document frequency and length
  normalization the BM25 way), so the query computes it in SQL: tf from the tsvector's positions,
  df by one GIN lookup per query term, N and avg_len from a totals row that triggers keep.
  Same ranking as SQLite, so quality measured on one holds for the other
  (tests/app/test_lexical_search.py checks both against a hand computation).

Filters (tenant, collection, documents, document ready) join inside the query, so the k best
are the k best the caller may see.

Or, with settings.lexical_engine = "tantivy", through a tantivy index (TantivyLexicalIndex, over
retrieval/lexical/tantivy_index.py): the same analyzer, and the scope's tenant or collection
becomes the ids of the collections it names, a read of the small collections table, so renaming a
collection never leaves the index behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import bindparam, text
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.lexical import POSTGRES_TABLE, POSTGRES_TOTALS, SQLITE_TABLE
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import BM25_B, BM25_K1, fts5_match, index_terms

if TYPE_CHECKING:
    # imported by whoever opens the index: tantivy loads only where it is the engine
    from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical


_SQLITE_SEARCH = f"""
SELECT {SQLITE_TABLE}.rowid, bm25({SQLITE_TABLE}) AS score
FROM {SQLITE_TABLE}
JOIN chunks ON chunks.id = {SQLITE_TABLE}.rowid
JOIN documents ON documents.id = chunks.document_id
JOIN collections ON collections.id = documents.collection_id
WHERE {SQLITE_TABLE} MATCH :match AND documents.status = 'ready' {{filters}}
ORDER BY score, {SQLITE_TABLE}.rowid
LIMIT :k
"""

# query_terms: each distinct term and how often the query holds it.
_POSTGRES_SEARCH = f"""
WITH query_terms AS (
    SELECT term, count(*) AS qtf FROM unnest(CAST(:terms AS text[])) AS q(term) GROUP BY term
), corpus AS (
    SELECT num_chunks::float8 AS n, num_terms::float8 / greatest(num_chunks, 1) AS avg_len
    FROM {POSTGRES_TOTALS}
), weights AS (
    SELECT query_terms.term, query_terms.qtf * greatest(
        ln((corpus.n - df.df + 0.5) / (df.df + 0.5)), 1e-6) AS weight
    FROM query_terms CROSS JOIN corpus CROSS JOIN LATERAL (
        SELECT count(*)::float8 AS df FROM {POSTGRES_TABLE} AS l
        WHERE l.terms @@ CAST(quote_literal(query_terms.term) AS tsquery)
    ) AS df
), hits AS (
    SELECT l.chunk_id, l.num_terms, l.terms
    FROM {POSTGRES_TABLE} AS l
    JOIN chunks ON chunks.id = l.chunk_id
    JOIN documents ON documents.id = chunks.document_id
    JOIN collections ON collections.id = documents.collection_id
    WHERE l.terms @@ CAST(:tsquery AS tsquery) AND documents.status = 'ready' {{filters}}
)
SELECT hits.chunk_id, sum(
    weights.weight * array_length(lexeme.positions, 1) * ({BM25_K1} + 1) / (
        array_length(lexeme.positions, 1)
        + {BM25_K1} * (1 - {BM25_B} + {BM25_B} * hits.num_terms / greatest(corpus.avg_len, 1e-9))
    )
) AS score
FROM hits
-- only the query's lexemes, cut out in C (marked by setweight, kept by ts_filter): unnesting a
-- whole chunk's tsvector would cost a row per distinct term of every hit
CROSS JOIN LATERAL unnest(
    ts_filter(setweight(hits.terms, 'A', CAST(:terms AS text[])), ARRAY[CAST('a' AS "char")])
) AS lexeme
JOIN weights ON weights.term = lexeme.lexeme
CROSS JOIN corpus
GROUP BY hits.chunk_id
ORDER BY score DESC, hits.chunk_id
LIMIT :k
"""


class DatabaseLexicalIndex:
    """The service's BM25 store (a retrieval.lexical.LexicalSearch): searches the chunk terms
    in the database, scoped by a Scope. It holds nothing in memory, so start-up builds
    nothing; ingest writes the terms (app/core/lexical.py) and chunk deletes remove them."""

    def __init__(self, sessions: sessionmaker[Session], analyzer: Analyzer | None = None) -> None:
        self._sessions = sessions
        self.analyzer = analyzer if analyzer is not None else Analyzer()

    def search(
        self, query: str, k: int, scope: Scope | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks within `scope` (None = every ready chunk) that
        share a term with `query`, best first; ties keep the lower id first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = index_terms(self.analyzer, query)
        if not terms:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        scope = scope if scope is not None else Scope()
        with self._sessions() as session:
            is_postgres = session.get_bind().dialect.name == "postgresql"
            filters, params = scope.sql_filters()
            if is_postgres:
                sql = _POSTGRES_SEARCH.format(filters=filters)
                params |= {"terms": terms, "tsquery": " | ".join(f"'{t}'" for t in set(terms))}
            else:
                sql = _SQLITE_SEARCH.format(filters=filters)
                params["match"] = fts5_match(terms)
            statement = text(sql)
            if scope.document_ids is not None:
                statement = statement.bindparams(bindparam("document_ids", expanding=True))
            rows = session.execute(statement, params | {"k": k}).all()
        # FTS5's bm25() is lower-is-better (negated for ORDER BY); ours is higher-is-better
        sign = 1.0 if is_postgres else -1.0
        scores = np.asarray([sign * r[1] for r in rows], dtype=np.float32)
        return scores, np.asarray([r[0] for r in rows], dtype=np.int64)

    def ids(self) -> np.ndarray:
        """Every chunk id the store holds terms for, sorted, as int64."""
        with self._sessions() as session:
            if session.get_bind().dialect.name == "postgresql":
                sql = f"SELECT chunk_id FROM {POSTGRES_TABLE} ORDER BY chunk_id"
            else:
                sql = f"SELECT rowid FROM {SQLITE_TABLE} ORDER BY rowid"
            return np.asarray(list(session.scalars(text(sql))), dtype=np.int64)


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
        self, query: str, k: int, scope: Scope | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks within `scope` (None = every chunk) that share
        a term with `query`, best first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = index_terms(self.analyzer, query)
        scope = scope if scope is not None else Scope()
        collection_ids = _collection_ids_of(self._sessions, scope)
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


def _collection_ids_of(sessions: sessionmaker[Session], scope: Scope) -> list[int] | None:
    with sessions() as session:
        return scope.collection_ids(session)
