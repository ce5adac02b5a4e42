"""Lexical search in the database: the chunks' BM25 terms, indexed, backfilled for every chunk.

SQLite: an FTS5 table (rowid = chunk id) over the space-joined terms, with the ascii tokenizer
and '_' as a token character, so FTS5 splits at the spaces only; a trigger removes a chunk's row
with the chunk. PostgreSQL: a table of tsvectors (built verbatim from the terms, never parsed by
PostgreSQL) with a GIN index; its foreign key cascades chunk deletes; a one-row table of totals
(chunks, terms) kept by triggers. The terms come from our
Analyzer (app/core/lexical.py), the one the service queries with.

NOTE: a later SQLite migration that recreates `chunks` (batch mode) drops the trigger with the
old table: it must create the trigger again.

Revision ID: 0004_lexical_search
Revises: 0003_chunk_ids_never_reused
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

from prefixrag.app.core.lexical import backfill_chunk_terms

revision: str = "0004_lexical_search"
down_revision: str | None = "0003_chunk_ids_never_reused"
branch_labels = None
depends_on = None

SQLITE_UP = (
    """CREATE VIRTUAL TABLE chunks_fts USING fts5(terms, tokenize="ascii tokenchars '_'")""",
    """CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks
    BEGIN DELETE FROM chunks_fts WHERE rowid = old.id; END""",
)
SQLITE_DOWN = ("DROP TRIGGER chunks_fts_delete", "DROP TABLE chunks_fts")
POSTGRES_UP = (
    """CREATE TABLE chunk_lexemes (
        chunk_id BIGINT PRIMARY KEY REFERENCES chunks (id) ON DELETE CASCADE,
        num_terms INTEGER NOT NULL,
        terms TSVECTOR NOT NULL
    )""",
    "CREATE INDEX ix_chunk_lexemes_terms ON chunk_lexemes USING gin (terms)",
    # BM25's N and average length, kept by statement triggers in the writers' transactions, so
    # a query reads one row instead of counting the table (FTS5 keeps the same totals itself)
    """CREATE TABLE chunk_lexemes_totals (
        id BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (id),
        num_chunks BIGINT NOT NULL,
        num_terms BIGINT NOT NULL
    )""",
    "INSERT INTO chunk_lexemes_totals (id, num_chunks, num_terms) VALUES (TRUE, 0, 0)",
    """CREATE FUNCTION chunk_lexemes_added() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE chunk_lexemes_totals
        SET num_chunks = num_chunks + d.n, num_terms = num_terms + d.t
        FROM (SELECT count(*) AS n, coalesce(sum(num_terms), 0) AS t FROM added) AS d;
        RETURN NULL;
    END $$""",
    """CREATE FUNCTION chunk_lexemes_removed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE chunk_lexemes_totals
        SET num_chunks = num_chunks - d.n, num_terms = num_terms - d.t
        FROM (SELECT count(*) AS n, coalesce(sum(num_terms), 0) AS t FROM removed) AS d;
        RETURN NULL;
    END $$""",
    """CREATE TRIGGER chunk_lexemes_added AFTER INSERT ON chunk_lexemes
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION chunk_lexemes_added()""",
    """CREATE TRIGGER chunk_lexemes_removed AFTER DELETE ON chunk_lexemes
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT EXECUTE FUNCTION chunk_lexemes_removed()""",
)
POSTGRES_DOWN = (
    "DROP TABLE chunk_lexemes",
    "DROP TABLE chunk_lexemes_totals",
    "DROP FUNCTION chunk_lexemes_added()",
    "DROP FUNCTION chunk_lexemes_removed()",
)


def upgrade() -> None:
    bind = op.get_bind()
    for statement in SQLITE_UP if bind.dialect.name == "sqlite" else POSTGRES_UP:
        op.execute(statement)
    backfill_chunk_terms(bind)


def downgrade() -> None:
    bind = op.get_bind()
    for statement in SQLITE_DOWN if bind.dialect.name == "sqlite" else POSTGRES_DOWN:
        op.execute(statement)
