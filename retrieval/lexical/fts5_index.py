"""A standalone BM25 index on SQLite FTS5: for benchmarks and tests that have ids and texts but
no service database (the service searches its own database, see app/services/lexical.py)."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence

import numpy as np

from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import fts5_match, index_terms

# The ascii tokenizer splits only on ASCII non-alphanumerics: with '_' a token character, it
# splits our space-joined terms at the spaces and nowhere else (non-ASCII are token characters).
FTS5_TOKENIZER = "ascii tokenchars '_'"


class Fts5Index:
    """Texts under int64 ids in an FTS5 table, ranked by FTS5's bm25() (k1=1.2, b=0.75).

    score(q, d) = sum over query terms t (once per occurrence in the query) of
        idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * len(d) / avg_len))
    with idf(t) = ln((N - df(t) + 0.5) / (df(t) + 0.5)), floored at 1e-6 (a term in over half
    the texts counts next to nothing), over every text held; len(d) counts terms. One lock
    guards the connection, so threads may add and search.
    """

    def __init__(self, analyzer: Analyzer | None = None, path: str = ":memory:") -> None:
        self.analyzer = analyzer if analyzer is not None else Analyzer()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute(
            f'CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(terms, tokenize="{FTS5_TOKENIZER}")'
        )

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM fts").fetchone()[0])

    def ids(self) -> np.ndarray:
        """The ids held, sorted, as int64."""
        with self._lock:
            rows = self._db.execute("SELECT rowid FROM fts ORDER BY rowid").fetchall()
        return np.asarray([r[0] for r in rows], dtype=np.int64)

    def add(self, ids: np.ndarray, texts: Sequence[str]) -> None:
        """Index `texts` under `ids`; an id already held raises ValueError and nothing changes."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        rows = [
            (int(i), " ".join(index_terms(self.analyzer, t)))
            for i, t in zip(ids, texts, strict=True)
        ]
        with self._lock:
            try:
                with self._db:
                    self._db.executemany("INSERT INTO fts (rowid, terms) VALUES (?, ?)", rows)
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"ids already indexed or repeated: {exc}") from exc

    def remove(self, ids: np.ndarray) -> int:
        """Drop the given ids (unknown ones are ignored); returns how many were removed."""
        wanted = json.dumps(np.asarray(ids, dtype=np.int64).reshape(-1).tolist())
        held = "SELECT rowid FROM fts WHERE rowid IN (SELECT value FROM json_each(?))"
        with self._lock, self._db:
            # counted first: the connection's change counters also count FTS5's own tables
            num_held = len(self._db.execute(held, (wanted,)).fetchall())
            self._db.execute(f"DELETE FROM fts WHERE rowid IN ({held})", (wanted,))
            return num_held

    def search(
        self, query: str, k: int, scope: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` texts among the ids in `scope` (None = all), best
        first; only texts sharing a term with the query, ties by lower id."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        terms = index_terms(self.analyzer, query)
        if not terms:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        sql = "SELECT rowid, bm25(fts) AS score FROM fts WHERE fts MATCH ?"
        params: list[object] = [fts5_match(terms)]
        if scope is not None:
            sql += " AND rowid IN (SELECT value FROM json_each(?))"
            params.append(json.dumps(np.asarray(scope, dtype=np.int64).tolist()))
        sql += " ORDER BY score, rowid LIMIT ?"
        params.append(k)
        with self._lock:
            rows = self._db.execute(sql, params).fetchall()
        # bm25() is negated so that an ORDER BY finds the best first; ours is higher-is-better
        scores = np.asarray([-r[1] for r in rows], dtype=np.float32)
        return scores, np.asarray([r[0] for r in rows], dtype=np.int64)
