"""Builders of test documents and small HTTP helpers shared by the app tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from fpdf import FPDF
from sqlalchemy import select

from prefixrag.app.core.models import Chunk, Document
from tests.app.conftest import app_state

PLAIN_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp.\n\n"
    "Ships far out at sea used the beam to avoid the rocky coast during storms.\n\n"
    "In the morning he wrote the weather and the passing ships into a leather logbook."
)

MARKDOWN = (
    "# Gardening\n\n"
    "Tomatoes need plenty of sun and regular watering through the summer.\n\n"
    "## Soil\n\n"
    "Compost and well-drained loam keep the roots healthy and free of rot.\n\n"
    "## Pests\n\n"
    "Aphids can be washed off the leaves with a gentle spray of soapy water.\n"
)

HTML = (
    "<html><head><title>Volcanoes</title></head><body>"
    "<h1>Volcanoes</h1><p>Magma rises through cracks in the crust of the earth.</p>"
    "<h2>Eruptions</h2><p>Ash clouds from an eruption can ground aircraft for days.</p>"
    "<script>var ignored = 'never indexed';</script>"
    "</body></html>"
)


def make_pdf(pages: list[str]) -> bytes:
    """A real PDF with one page per string (built with fpdf2)."""
    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def upload(
    client: TestClient,
    name: str,
    data: bytes,
    *,
    content_type: str = "application/octet-stream",
    wait: bool = True,
    **fields: str,
) -> Any:
    """POST a multipart file; returns the response."""
    url = "/v1/documents?wait=true" if wait else "/v1/documents"
    return client.post(url, files={"file": (name, data, content_type)}, data=fields)


def index_ids(client: TestClient) -> set[int]:
    """The chunk ids the vector index holds."""
    index = app_state(client).index
    if index is None:
        raise RuntimeError("index not loaded")
    return {int(i) for i in np.asarray(index.ids())}


def chunk_ids(client: TestClient, document_id: int | None = None) -> set[int]:
    """Chunk ids in the database (of one document, or of all ready documents)."""
    sessions = app_state(client).sessions
    if sessions is None:
        raise RuntimeError("db not loaded")
    query = select(Chunk.id).join(Document)
    if document_id is None:
        query = query.where(Document.status == "ready")
    else:
        query = query.where(Chunk.document_id == document_id)
    with sessions() as session:
        return set(session.scalars(query))
