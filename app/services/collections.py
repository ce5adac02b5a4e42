"""Collections are created on first use by the ingest service."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app.models import Collection


def get_or_create_collection(sessions: sessionmaker[Session], name: str) -> int:
    """The id of collection `name`, creating it if needed (safe under concurrent callers)."""
    with sessions() as session:
        found = session.scalar(select(Collection.id).where(Collection.name == name))
        if found is not None:
            return found
        row = Collection(name=name)
        session.add(row)
        try:
            session.commit()
            return row.id
        except IntegrityError:
            session.rollback()
            found = session.scalar(select(Collection.id).where(Collection.name == name))
            if found is None:
                raise
            return found
