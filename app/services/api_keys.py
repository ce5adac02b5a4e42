"""API keys: create (shown once), list, revoke, and resolve a presented key to its tenant.

Keys are 256 random bits, so a single SHA-256 is enough to store them: there is nothing to
brute-force that a slow password hash would protect (unlike a human-chosen password).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.errors import InvalidInputError
from prefixrag.app.core.models import ApiKey, utcnow

KEY_PREFIX = "prk_"
MAX_NAME_CHARS = 200


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """What may be shown about a key: never the key itself, only its first characters."""

    id: int
    name: str
    tenant: str
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def hash_key(key: str) -> str:
    """The stored form of a key: hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(*, sessions: sessionmaker[Session], name: str) -> tuple[KeyInfo, str]:
    """A new key for tenant `name`; returns its info and the key, which is not stored.

    InvalidInputError for a bad name or when `name` already has an active key (revoke it first:
    the new key then takes over the tenant's data).
    """
    name = name.strip()
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidInputError(f"a key name must be 1 to {MAX_NAME_CHARS} printable characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with sessions() as session:
        if _active_by_name(session, name) is not None:
            raise InvalidInputError(f"an active key named {name!r} exists; revoke it first")
        row = ApiKey(name=name, tenant=name, key_hash=hash_key(key), key_prefix=key[:12])
        session.add(row)
        session.commit()
        return _info(row), key


def list_keys(*, sessions: sessionmaker[Session], include_revoked: bool = False) -> list[KeyInfo]:
    """Every key in creation order, active ones only unless `include_revoked`."""
    query = select(ApiKey).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    with sessions() as session:
        return [_info(row) for row in session.scalars(query)]


def revoke_key(*, sessions: sessionmaker[Session], name: str) -> KeyInfo:
    """Revoke the active key named `name` (it stops working at once); InvalidInputError if none."""
    with sessions() as session:
        row = _active_by_name(session, name)
        if row is None:
            raise InvalidInputError(f"no active key named {name!r}")
        row.revoked_at = utcnow()
        session.commit()
        return _info(row)


def tenant_for_key(*, session: Session, key: str) -> str | None:
    """The tenant of an active key, or None for an unknown or revoked one."""
    query = select(ApiKey.tenant).where(
        ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)
    )
    return session.scalar(query)


def any_active_key(*, session: Session) -> bool:
    """True once at least one key is active: from then on every request needs one."""
    return session.scalar(select(ApiKey.id).where(ApiKey.revoked_at.is_(None)).limit(1)) is not None


def _active_by_name(session: Session, name: str) -> ApiKey | None:
    query = select(ApiKey).where(ApiKey.name == name, ApiKey.revoked_at.is_(None))
    return session.scalar(query)


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.name, row.tenant, row.key_prefix, row.created_at, row.revoked_at)
