"""A database that is down answers 503 with a reason, not 500 (the compose smoke test stops
PostgreSQL under a running app; this is the same answer without Docker)."""

from __future__ import annotations

import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.testclient import TestClient

from prefixrag.app.api.error_handlers import install_error_handlers


def _app(error: Exception) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/documents")
    def documents() -> None:
        raise error

    return app


def test_operational_error_is_503_with_a_reason() -> None:
    error = sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
    response = TestClient(_app(error), raise_server_exceptions=False).get("/v1/documents")
    assert response.status_code == 503
    assert response.json() == {"detail": "database unavailable"}
    assert response.headers["Retry-After"] == "5"


def test_pool_timeout_is_503() -> None:
    error = sqlalchemy.exc.TimeoutError("QueuePool limit reached")
    response = TestClient(_app(error), raise_server_exceptions=False).get("/v1/documents")
    assert response.status_code == 503


def test_readiness_asks_the_database_again(tmp_path) -> None:
    from prefixrag.app.core.db import make_engine
    from prefixrag.app.core.settings import Settings
    from prefixrag.app.state import OK, AppState, ComponentLoader

    state = AppState(Settings(data_dir=tmp_path), loaders=[ComponentLoader("db", lambda _: None)])
    state.set_status("db", OK)
    state.engine = make_engine(f"sqlite:///{tmp_path / 'up.db'}")
    assert state.live_snapshot()["db"] == OK
    # a PostgreSQL that is gone (nothing listens on port 1): recorded "ok" at start, down now
    state.engine = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/gone")
    live = state.live_snapshot()
    assert live["db"] == "unavailable: OperationalError"
    assert state.status("db") == OK and not state.ready_in(live)
