"""Alembic environment: URL from the settings (or the caller), metadata from app.models."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from prefixrag.app.core.db import make_engine
from prefixrag.app.core.lexical import is_lexical_table
from prefixrag.app.core.models import Base
from prefixrag.app.core.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    return url or get_settings().resolved_database_url


def _include_name(name: str | None, type_: str, _parents: object) -> bool:
    # the lexical store's tables (FTS5 and its shadow tables, tsvectors) are no ORM models
    return not (type_ == "table" and is_lexical_table(name))


def _configure(conn: Connection) -> None:
    context.configure(
        connection=conn,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place: batch mode copies the table instead.
        render_as_batch=conn.dialect.name == "sqlite",
        compare_type=True,
        include_name=_include_name,
    )


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_database_url())
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
