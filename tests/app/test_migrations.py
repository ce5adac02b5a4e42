"""Migrations run up and down on SQLite and PostgreSQL and match the ORM models exactly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from app.db import current_revision, downgrade_db, head_revision, make_engine, upgrade_db
from app.models import Base

TABLES = {"collections", "documents", "chunks"}


def test_upgrade_creates_the_schema_of_the_models(database_url: str) -> None:
    upgrade_db(database_url)
    engine = make_engine(database_url)
    try:
        assert current_revision(engine) == head_revision()
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_downgrade_to_base_and_upgrade_again(database_url: str) -> None:
    upgrade_db(database_url)
    downgrade_db(database_url, "base")
    engine = make_engine(database_url)
    try:
        assert current_revision(engine) is None
        assert not TABLES & set(inspect(engine).get_table_names())
        upgrade_db(database_url)
        upgrade_db(database_url)  # idempotent
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
