"""The chunks' lexical terms in the database, beside the chunk rows (migration 0004 made them).

- SQLite: the FTS5 table `chunks_fts`, rowid = chunk id, column `terms` (space-joined terms).
  A trigger deletes a chunk's row with the chunk.
- PostgreSQL: the table `chunk_lexemes` (chunk_id, num_terms, terms tsvector) with a GIN index
  on `terms`; its foreign key cascades a chunk's delete. Triggers keep `chunk_lexemes_totals`.

So a chunk's terms are written in the transaction that writes the chunk, and leave with it: the
lexical side can never disagree with the rows. Neither table is an ORM model, because each
exists on one database only.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import index_terms, searchable_text, tsvector_literal

SQLITE_TABLE = "chunks_fts"
POSTGRES_TABLE = "chunk_lexemes"
POSTGRES_TOTALS = "chunk_lexemes_totals"  # one row: chunks and terms held, for BM25's N and avg
# FTS5 keeps shadow tables named after its table: all of them are the lexical store's.
LEXICAL_TABLE_PREFIXES = (SQLITE_TABLE, POSTGRES_TABLE)

_INSERT_SQLITE = text(f"INSERT INTO {SQLITE_TABLE} (rowid, terms) VALUES (:id, :terms)")
# One statement per batch (arrays, not executemany), so the totals trigger fires once per batch.
_INSERT_POSTGRES = text(
    f"INSERT INTO {POSTGRES_TABLE} (chunk_id, num_terms, terms) "
    "SELECT id, num_terms, CAST(terms AS tsvector) FROM unnest("
    "CAST(:ids AS bigint[]), CAST(:num_terms AS integer[]), CAST(:terms AS text[])"
    ") AS batch (id, num_terms, terms)"
)


def is_lexical_table(name: str | None) -> bool:
    """True for the lexical store's tables (schema comparisons skip them: not ORM models)."""
    return name is not None and name.startswith(LEXICAL_TABLE_PREFIXES)


def insert_chunk_terms(
    db: Session | Connection, analyzer: Analyzer, chunk_ids: Sequence[int], texts: Sequence[str]
) -> None:
    """Store the terms of `texts` for the chunks `chunk_ids`, in `db`'s transaction.

    `texts` are what BM25 indexes (retrieval.lexical.searchable_text of each chunk).
    """
    if len(chunk_ids) != len(texts):
        raise ValueError(f"{len(chunk_ids)} ids for {len(texts)} texts")
    if not chunk_ids:
        return
    terms = [index_terms(analyzer, t) for t in texts]
    dialect = db.dialect if isinstance(db, Connection) else db.get_bind().dialect
    if dialect.name == "postgresql":
        batch = {
            "ids": [int(i) for i in chunk_ids],
            "num_terms": [len(ts) for ts in terms],
            "terms": [tsvector_literal(ts) for ts in terms],
        }
        db.execute(_INSERT_POSTGRES, batch)
    else:
        rows = [
            {"id": int(i), "terms": " ".join(ts)} for i, ts in zip(chunk_ids, terms, strict=True)
        ]
        db.execute(_INSERT_SQLITE, rows)


def backfill_chunk_terms(conn: Connection, batch_size: int = 2048) -> int:
    """Store the terms of every chunk row, `batch_size` rows at a time; returns how many.

    For a store just created (migration 0004), with the analyzer the service queries with.
    """
    analyzer = Analyzer()
    last_id, num_chunks = -1, 0
    while True:
        rows = conn.execute(
            text("SELECT id, text, heading FROM chunks WHERE id > :last ORDER BY id LIMIT :n"),
            {"last": last_id, "n": batch_size},
        ).all()
        if not rows:
            return num_chunks
        texts = [searchable_text(r[1], r[2]) for r in rows]
        insert_chunk_terms(conn, analyzer, [r[0] for r in rows], texts)
        last_id, num_chunks = int(rows[-1][0]), num_chunks + len(rows)
