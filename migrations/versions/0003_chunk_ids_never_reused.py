"""Chunk ids are never reused on SQLite (AUTOINCREMENT).

A chunk id is also its FAISS vector id. Without AUTOINCREMENT SQLite hands out max(id)+1, so an
upload right after a delete of the newest chunks could get the ids of vectors not yet removed
from the index. PostgreSQL sequences never go back, so only SQLite changes.

Revision ID: 0003_chunk_ids_never_reused
Revises: 0002_api_keys_and_tenants
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision: str = "0003_chunk_ids_never_reused"
down_revision: str | None = "0002_api_keys_and_tenants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    _set_autoincrement(True)


def downgrade() -> None:
    _set_autoincrement(False)


def _set_autoincrement(on: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    # SQLite cannot alter a table's key: batch mode copies it into a new table
    with op.batch_alter_table(
        "chunks", recreate="always", table_kwargs={"sqlite_autoincrement": on}
    ):
        pass
