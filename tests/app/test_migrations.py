"""Migrations run up and down on SQLite and PostgreSQL and match the ORM models exactly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import delete, inspect, text

from prefixrag.app.core.db import (
    current_revision,
    downgrade_db,
    head_revision,
    make_engine,
    make_sessionmaker,
    upgrade_db,
)
from prefixrag.app.core.lexical import is_lexical_table
from prefixrag.app.core.models import DEFAULT_TENANT, Base, Chunk, Collection, Document, utcnow

TABLES = {"api_keys", "collections", "documents", "chunks", "chunk_sentences"}


def test_upgrade_creates_the_schema_of_the_models(database_url: str) -> None:
    upgrade_db(database_url)
    engine = make_engine(database_url)
    try:
        assert current_revision(engine) == head_revision()
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            # the lexical store's tables are no ORM models (each exists on one database only)
            opts = {"include_name": lambda name, type_, _: not is_lexical_table(name)}
            context = MigrationContext.configure(conn, opts=opts)
            diff = compare_metadata(context, Base.metadata)
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


def test_deleted_chunk_ids_are_never_handed_out_again(database_url: str) -> None:
    # A chunk id is its vector id: reusing one could collide with a vector not yet removed.
    upgrade_db(database_url)
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            collection = Collection(name="c", tenant="t")
            doc = Document(
                collection=collection,
                title="d",
                filename=None,
                media_type="text/plain",
                num_bytes=1,
                sha256="0" * 64,
                status="ready",
                meta={},
            )
            session.add(doc)
            session.flush()

            def add_chunk(ordinal: int) -> int:
                chunk = Chunk(
                    document_id=doc.id,
                    ordinal=ordinal,
                    text="t",
                    char_start=0,
                    char_end=1,
                    num_tokens=1,
                )
                session.add(chunk)
                session.flush()
                return chunk.id

            newest = max(add_chunk(0), add_chunk(1))
            session.execute(delete(Chunk).where(Chunk.id == newest))
            session.commit()
            assert add_chunk(2) > newest
            session.commit()
    finally:
        engine.dispose()


def test_collections_from_before_keys_belong_to_the_default_tenant(database_url: str) -> None:
    upgrade_db(database_url, "0001_initial")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO collections (name, created_at) VALUES ('old', :now)"),
                {"now": utcnow()},
            )
        upgrade_db(database_url)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT tenant, name FROM collections")).all()
        assert [tuple(r) for r in rows] == [(DEFAULT_TENANT, "old")]
    finally:
        engine.dispose()
