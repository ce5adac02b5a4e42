"""Bearer-key authentication: which tenant a request acts for.

With no active key and `require_auth` off, every request is the default tenant (a single-user
install). Once a key exists, or `require_auth` is on, every route behind `get_tenant` (in
api/deps.py) answers 401 without a valid `Authorization: Bearer <key>`. Before that, any key (or
none) is accepted as the default tenant.
"""

from __future__ import annotations

from fastapi import Request
from sqlalchemy.orm import Session

from prefixrag.app.core.errors import AuthenticationError
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


def resolve_tenant(*, session: Session, token: str | None, require_auth: bool) -> str:
    """The tenant `token` acts for; AuthenticationError (401) for a missing or wrong key."""
    tenant = None if token is None else tenant_for_key(session=session, key=token)
    if tenant is not None:
        return tenant
    if require_auth or any_active_key(session=session):
        raise AuthenticationError(
            "an API key is required: send 'Authorization: Bearer <key>'"
            if token is None
            else "invalid or revoked API key"
        )
    # Open install: OpenAI clients insist on sending some key, so any key is accepted.
    return DEFAULT_TENANT
