"""API keys, and a tenant on every collection.

Revision ID: 0002_api_keys_and_tenants
Revises: 0001_initial
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002_api_keys_and_tenants"
down_revision: str | None = "0001_initial"
branch_labels = None
depends_on = None

# Collections from before keys existed belong to the tenant of unauthenticated requests.
DEFAULT_TENANT = "default"


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_hash"),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    # batch mode: SQLite can only change constraints by copying the table
    with op.batch_alter_table("collections") as batch:
        batch.add_column(
            sa.Column("tenant", sa.String(200), nullable=False, server_default=DEFAULT_TENANT)
        )
        batch.drop_constraint("uq_collections_name", type_="unique")
        batch.create_unique_constraint("uq_collections_tenant_name", ["tenant", "name"])


def downgrade() -> None:
    # Refuses (unique violation) when two tenants hold collections of the same name.
    with op.batch_alter_table("collections") as batch:
        batch.drop_constraint("uq_collections_tenant_name", type_="unique")
        batch.create_unique_constraint("uq_collections_name", ["name"])
        batch.drop_column("tenant")
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_table("api_keys")
