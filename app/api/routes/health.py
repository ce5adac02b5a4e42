"""Liveness (/healthz: the process answers) and readiness (/readyz: every component loaded)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from prefixrag.app.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """200 as soon as the process serves requests."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(state: StateDep) -> JSONResponse:
    """200 with each component's status once ready, else 503 with the same map; the model that
    answers once the LLM is loaded, and with engine replicas, each replica and its state too."""
    components = state.live_snapshot()  # the database asked now: it may have gone since start
    body: dict[str, Any] = {"components": components}
    if state.llm is not None:
        body["model"] = state.llm.model_id
    replicas = state.llm.replicas() if state.llm is not None else None
    if replicas is not None:
        body["replicas"] = replicas
    plan = state.llm.memory_plan() if state.llm is not None else None
    if plan is not None:
        body["memory_plan"] = plan
    if state.ready_in(components):
        return JSONResponse({"status": "ok", **body})
    return JSONResponse({"status": "not ready", **body}, status_code=503)
