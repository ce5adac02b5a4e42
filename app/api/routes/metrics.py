"""GET /metrics: Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from prefixrag.app.api.deps import StateDep
from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.schemas.errors import error_responses

router = APIRouter(tags=["metrics"], responses=error_responses(401, 503))


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(state: StateDep) -> Response:
    """Every series of this app's registry."""
    if state.metrics is None:
        raise NotReadyError("metrics are not installed on this app")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
