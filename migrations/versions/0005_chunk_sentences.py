"""The chunks' sentences for evidence spans, embedded at ingest and kept (derived data: a chunk
without a row gets one the first time a question cites it).

Revision ID: 0005_chunk_sentences
Revises: 0004_lexical_search
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005_chunk_sentences"
down_revision: str | None = "0004_lexical_search"
branch_labels = None
depends_on = None

# chunks.id's type: BIGINT, but the INTEGER SQLite auto-increments
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "chunk_sentences",
        sa.Column(
            "chunk_id",
            BIG_ID,
            sa.ForeignKey("chunks.id", ondelete="CASCADE", name="fk_chunk_sentences_chunk"),
            primary_key=True,
        ),
        sa.Column("key", sa.LargeBinary(16), nullable=False),
        sa.Column("spans", sa.LargeBinary(), nullable=False),
        sa.Column("vectors", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("chunk_sentences")
