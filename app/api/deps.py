"""FastAPI dependencies as `Annotated` aliases: the app state, a DB session, the services."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.services.ingest import IngestService
from prefixrag.app.state import AppState
from prefixrag.retrieval.pipeline import Retriever


def get_state(request: Request) -> AppState:
    """The AppState that create_app attached to the application."""
    state: AppState = request.app.state.prefixrag
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_db(state: StateDep) -> Iterator[Session]:
    """A session for one request; 503 until the database is ready."""
    state.require("db")
    if state.sessions is None:
        raise NotReadyError("database is not ready")
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]


def get_ingest(state: StateDep) -> IngestService:
    """The ingest service; 503 until the database, embedder and index are ready."""
    state.require("db", "embedder", "index")
    if state.ingest is None:
        raise NotReadyError("ingest service is not ready")
    return state.ingest


IngestDep = Annotated[IngestService, Depends(get_ingest)]


def get_retriever(state: StateDep) -> Retriever:
    """The retriever; 503 until the database, embedder and index are ready."""
    state.require("db", "embedder", "index")
    if state.retriever is None:
        raise NotReadyError("retriever is not ready")
    return state.retriever


RetrieverDep = Annotated[Retriever, Depends(get_retriever)]
