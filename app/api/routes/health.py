"""Liveness (/healthz: the process answers) and readiness (/readyz: every component loaded)."""

from __future__ import annotations

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
    """200 with each component's status once ready, else 503 with the same map."""
    components = state.snapshot()
    if state.is_ready:
        return JSONResponse({"status": "ok", "components": components})
    return JSONResponse({"status": "not ready", "components": components}, status_code=503)
