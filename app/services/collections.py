"""Collections are created on first use by the ingest service."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import DEFAULT_TENANT, Collection


def get_or_create_collection(
    *, sessions: sessionmaker[Session], name: str, tenant: str = DEFAULT_TENANT
) -> int:
    """The id of `tenant`'s collection `name`, creating it if needed (safe under concurrent
    callers)."""
    query = select(Collection.id).where(Collection.tenant == tenant, Collection.name == name)
    with sessions() as session:
        found = session.scalar(query)
        if found is not None:
            return found
        row = Collection(name=name, tenant=tenant)
        session.add(row)
        try:
            session.commit()
            return row.id
        except IntegrityError:
            session.rollback()
            found = session.scalar(query)
            if found is None:
                raise
            return found
