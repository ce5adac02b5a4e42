"""Every FastAPI dependency of the API, as `Annotated` aliases: the app state, a DB session,
the tenant, and each loaded service (503 until it has loaded)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from prefixrag.app.api.auth import bearer_token, resolve_tenant
from prefixrag.app.core.errors import NotReadyError, OpenAIError
from prefixrag.app.services.ingest import IngestService
from prefixrag.app.services.llm import LLMService
from prefixrag.app.services.scopes import ScopeCache
from prefixrag.app.state import AppState
from prefixrag.retrieval.pipeline import Retriever

T = TypeVar("T")


def get_state(request: Request) -> AppState:
    """The AppState that create_app attached to the application."""
    state: AppState = request.app.state.prefixrag
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_db(state: StateDep) -> Iterator[Session]:
    """A session for one request; 503 until the database is ready."""
    state.require("db")
    with loaded(state.sessions, "database")() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]


def get_tenant(request: Request, state: StateDep) -> str:
    """The tenant of this request (resolved once per request); 401 for a missing or wrong key
    once keys are in use."""
    cached: str | None = getattr(request.state, "tenant", None)
    if cached is not None:
        return cached
    token = bearer_token(request)
    state.require("db")
    with loaded(state.sessions, "database")() as session:
        tenant = resolve_tenant(
            session=session, token=token, require_auth=state.settings.require_auth
        )
    request.state.tenant = tenant
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]


def loaded(component: T | None, name: str) -> T:
    """`component` once it has loaded; NotReadyError (503) before."""
    if component is None:
        raise NotReadyError(f"{name} is not ready")
    return component


def get_ingest(state: StateDep) -> IngestService:
    """The ingest service; 503 until the database, embedder and index are ready."""
    state.require("db", "embedder", "index")
    return loaded(state.ingest, "ingest service")


IngestDep = Annotated[IngestService, Depends(get_ingest)]


def get_retriever(state: StateDep) -> Retriever:
    """The retriever; 503 until the database, embedder and index are ready."""
    state.require("db", "embedder", "index")
    return loaded(state.retriever, "retriever")


RetrieverDep = Annotated[Retriever, Depends(get_retriever)]


def get_scopes(state: StateDep) -> ScopeCache:
    """The searches' cached allowed chunk ids; 503 until the index is ready."""
    state.require("db", "embedder", "index")
    return loaded(state.scopes, "search scopes")


ScopesDep = Annotated[ScopeCache, Depends(get_scopes)]


def get_llm(state: StateDep) -> LLMService:
    """The LLM service; an OpenAI-style 503 until it has loaded."""
    if state.llm is None or state.status("llm") != "ok":
        raise OpenAIError(f"the model is not ready ({state.status('llm')})", status_code=503)
    return state.llm


LLMDep = Annotated[LLMService, Depends(get_llm)]
