"""Bearer-key authentication: which tenant a request acts for.

With no active key and `require_auth` off, every request is the default tenant (a single-user
install). Once a key exists, or `require_auth` is on, every route that depends on `get_tenant`
answers 401 without a valid `Authorization: Bearer <key>`. Before that, any key (or none) is
accepted as the default tenant.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from prefixrag.app.api.deps import StateDep
from prefixrag.app.core.errors import AuthenticationError, NotReadyError
from prefixrag.app.core.models import DEFAULT_TENANT
from prefixrag.app.services.api_keys import any_active_key, tenant_for_key


def bearer_token(request: Request) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None when there is none."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <API key>'")
    return token.strip()


def get_tenant(request: Request, state: StateDep) -> str:
    """The tenant of this request; AuthenticationError (401) for a missing or wrong key."""
    cached: str | None = getattr(request.state, "tenant", None)
    if cached is not None:
        return cached
    token = bearer_token(request)
    state.require("db")
    if state.sessions is None:
        raise NotReadyError("database is not ready")
    with state.sessions() as session:
        tenant = None if token is None else tenant_for_key(session, token)
        if tenant is None:
            if state.settings.require_auth or any_active_key(session):
                raise AuthenticationError(
                    "an API key is required: send 'Authorization: Bearer <key>'"
                    if token is None
                    else "invalid or revoked API key"
                )
            # Open install: OpenAI clients insist on sending some key, so any key is accepted.
            tenant = DEFAULT_TENANT
    request.state.tenant = tenant
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]


def request_tenant(request: Request) -> str:
    """The tenant `get_tenant` resolved for this request (every non-public router runs it)."""
    tenant: str | None = getattr(request.state, "tenant", None)
    if tenant is None:
        raise RuntimeError("get_tenant did not run for this route")
    return tenant
