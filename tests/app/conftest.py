"""App fixtures: a fresh database per test (SQLite, and PostgreSQL when
PREFIXRAG_TEST_DATABASE_URL is set), a temporary data dir, and one embedder per session."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.main import create_app
from prefixrag.app.state import AppState
from prefixrag.retrieval.embedder import Embedder

PG_ENV = "PREFIXRAG_TEST_DATABASE_URL"
LOAD_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    """The packaged all-MiniLM-L6-v2, loaded once for the whole session."""
    return Embedder(packaged_embedder_path())


DATABASES = ["sqlite", "postgresql"]


@pytest.fixture(params=DATABASES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file, or a fresh schema in the PostgreSQL test database."""
    yield from fresh_database(request.param, tmp_path)


def fresh_database(kind: str, tmp_dir: Path) -> Iterator[str]:
    """Yield the URL of an empty database of `kind` and drop it afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_dir / 'test.db'}"
        return
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set")
    yield from _postgres_schema(base)


def _postgres_schema(base: str) -> Iterator[str]:
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory over a freshly migrated database (no app around it)."""
    upgrade_db(database_url)
    engine = make_engine(database_url)
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """Settings on a temporary data dir; small chunks so short test documents span several."""
    return make_settings(tmp_path, database_url)


def make_settings(tmp_path: Path, database_url: str) -> Settings:
    """Test settings: data under `tmp_path`, no loadable reranker, 64 KiB upload limit."""
    return Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        embed_model=packaged_embedder_path(),
        rerank_model=str(tmp_path / "no-such-cross-encoder"),
        chunk_tokens=48,
        chunk_overlap=8,
        max_upload_bytes=64 * 1024,
        index_use_gpu="no",
        load_llm=False,  # the LLM has its own tests; these are about documents and search
    )


@pytest.fixture
def client(settings: Settings, embedder: Embedder) -> Iterator[TestClient]:
    """A TestClient on a fully loaded app (startup and shutdown run around the test)."""
    with started(settings, embedder) as test_client:
        yield test_client


class started:
    """Context manager: create the app, run its lifespan, wait until loading has finished."""

    def __init__(self, settings: Settings, embedder: object, **kwargs: object) -> None:
        self.app = create_app(settings, embedder=embedder, **kwargs)  # type: ignore[arg-type]
        self._client = TestClient(self.app)

    def __enter__(self) -> TestClient:
        self._client.__enter__()
        if not app_state(self._client).wait_loaded(LOAD_TIMEOUT_S):
            raise TimeoutError("the app did not finish loading")
        return self._client

    def __exit__(self, *exc: object) -> None:
        self._client.__exit__(*exc)


def app_state(client: TestClient) -> AppState:
    """The AppState behind a TestClient's app."""
    state: AppState = client.app.state.prefixrag  # type: ignore[attr-defined]
    return state
