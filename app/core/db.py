"""Database engines, sessions and migrations (Alembic, configured in code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets foreign keys on, WAL and a busy timeout for threads."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite"):
        # a database that went away fails a request in seconds (a 503), not after TCP's minutes
        connect_args = {"connect_timeout": 5} if parsed.drivername.startswith("postgresql") else {}
        return create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_on_connect)
    return engine


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    # Without this pragma SQLite ignores ON DELETE CASCADE and foreign keys altogether.
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit, so views can be built afterwards."""
    return sessionmaker(engine, expire_on_commit=False)


def migrations_dir() -> Path:
    """Where the Alembic environment lives: the folder of the installed `prefixrag.migrations`."""
    # A namespace package has no __file__; its env.py is found without being run.
    spec = importlib.util.find_spec("prefixrag.migrations.env")
    if spec is None or spec.origin is None:
        raise RuntimeError("prefixrag.migrations is not installed")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Config:
    """An Alembic config for `url`, built in code so it works from an installed package."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Passed as an attribute, not an ini option, so '%' in passwords needs no escaping.
    config.attributes["database_url"] = url
    return config


def upgrade_db(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (idempotent)."""
    command.upgrade(alembic_config(url), revision)


def downgrade_db(url: str, revision: str) -> None:
    """Revert migrations down to `revision` ("base" drops everything)."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    """The newest migration revision shipped with the code."""
    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None before the first migration."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
