"""Document upload, listing, lookup and deletion. Writes go through the ingest service."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from prefixrag.app.api.deps import IngestDep, SessionDep, StateDep, TenantDep
from prefixrag.app.api.uploads import read_ingest_request
from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.schemas.documents import DocumentAccepted, DocumentOut, DocumentPage
from prefixrag.app.schemas.errors import COMMON_CODES, error_responses
from prefixrag.app.schemas.fields import MAX_ROW_ID
from prefixrag.app.services.documents import get_document, list_documents

# a document id that cannot exist is refused (422) before it reaches the database
DocumentId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]

router = APIRouter(
    prefix="/v1/documents", tags=["documents"], responses=error_responses(*COMMON_CODES)
)

_UPLOAD_DOC = {
    "requestBody": {
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "title": {"type": "string"},
                        "collection": {"type": "string", "default": "default"},
                        "metadata": {"type": "string", "description": "a JSON object"},
                    },
                }
            },
            "application/json": {"schema": {"$ref": "#/components/schemas/DocumentTextIn"}},
        }
    }
}


@router.post(
    "",
    status_code=202,
    response_model=DocumentAccepted,
    responses={201: {"model": DocumentOut}, **error_responses(409, 415, 429)},
    openapi_extra=_UPLOAD_DOC,
)
async def create_document(
    request: Request, state: StateDep, ingest: IngestDep, tenant: TenantDep, wait: bool = False
) -> JSONResponse:
    """Queue a document (202), or with `?wait=true` ingest it and return it (201)."""
    upload = await read_ingest_request(request)
    upload.tenant = tenant
    ticket = await run_in_threadpool(ingest.submit, upload)
    if not wait:
        accepted = DocumentAccepted(document_id=ticket.document_id, status="pending")
        return JSONResponse(accepted.model_dump(), status_code=202)
    await asyncio.wrap_future(ticket.future)
    document = await run_in_threadpool(_load, state, ticket.document_id, tenant)
    return JSONResponse(jsonable_encoder(document), status_code=201)


@router.get("", response_model=DocumentPage)
def list_all(
    session: SessionDep,
    tenant: TenantDep,
    collection: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> DocumentPage:
    """Documents in upload order, a page at a time, optionally from one collection."""
    return list_documents(
        session=session, tenant=tenant, collection=collection, limit=limit, offset=offset
    )


@router.get("/{document_id}", response_model=DocumentOut, responses=error_responses(404))
def get_one(document_id: DocumentId, session: SessionDep, tenant: TenantDep) -> DocumentOut:
    """One document with its status, chunk count and error."""
    return get_document(session=session, document_id=document_id, tenant=tenant)


@router.delete("/{document_id}", status_code=204, responses=error_responses(404, 409))
async def delete_one(
    document_id: DocumentId, ingest: IngestDep, tenant: TenantDep, state: StateDep
) -> Response:
    """Delete a document with its chunks, its vectors and its chunks' cached KV."""
    await run_in_threadpool(ingest.delete, document_id, tenant)
    if state.llm is not None:
        await state.llm.forget_document(tenant, document_id)
    return Response(status_code=204)


def _load(state: StateDep, document_id: int, tenant: str) -> DocumentOut:
    if state.sessions is None:
        raise NotReadyError("database is not ready")
    with state.sessions() as session:
        return get_document(session=session, document_id=document_id, tenant=tenant)
