"""The browser page: GET / serves it, /static/* serves its CSS and JS (no build step)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

router = APIRouter(tags=["web"])


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    """The single-page UI: upload and list documents, ask questions, read streamed answers."""
    # no-cache: the page names its assets without a version, so a stale copy could mix releases.
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


router.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
