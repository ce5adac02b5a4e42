"""Lexical search in the database: the chunks' BM25 terms, indexed, backfilled for every chunk.

SQLite: an FTS5 table (rowid = chunk id) over the space-joined terms, with the ascii tokenizer
and '_' as a token character, so FTS5 splits at the spaces only; a trigger removes a chunk's row
with the chunk. PostgreSQL: a table of tsvectors (built verbatim from the terms, never parsed by
PostgreSQL) with a GIN index; its foreign key cascades chunk deletes. The terms come from our
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
)
POSTGRES_DOWN = ("DROP TABLE chunk_lexemes",)


def upgrade() -> None:
    bind = op.get_bind()
    for statement in SQLITE_UP if bind.dialect.name == "sqlite" else POSTGRES_UP:
        op.execute(statement)
    backfill_chunk_terms(bind)


def downgrade() -> None:
    bind = op.get_bind()
    for statement in SQLITE_DOWN if bind.dialect.name == "sqlite" else POSTGRES_DOWN:
        op.execute(statement)
