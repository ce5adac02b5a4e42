"""Which chunk ids a tenant's vector search may return, as cached bitmaps kept current by ingest.

A search used to load every id of the tenant from SQL and build a FAISS selector from them: at a
million chunks that was the query's whole cost. Now each (tenant, collection) scope, and each
tenant as a whole (collection None), has an IdBitmap (1 bit per chunk id: 125 KB per million
ids), built from SQL on first use and then updated in place of a rebuild: ingest adds a ready
document's ids to its scopes, a delete takes ids out of every scope.

Why this is exact:
- a bit is only ever set for a ready chunk of that scope: read from SQL, or added by the ingest
  that made the document ready in that collection, after its commit;
- chunk ids are never reused (AUTOINCREMENT on SQLite, a sequence on PostgreSQL), so a deleted
  chunk's stale bit can only name a row that no longer exists, which the row load drops;
- a bitmap built from SQL is kept only if no ingest or delete was noted while it was read (the
  generation did not move); otherwise it serves that one search and is read again next time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.retrieval.id_bitmap import IdBitmap

ScopeKey = tuple[str, str | None]  # (tenant, collection name, or None for the whole tenant)


class ScopeCache:
    """The ready chunk ids of each (tenant, collection) scope as IdBitmaps, least recently used
    first out past `max_scopes` (each holds max chunk id / 8 bytes). Thread-safe."""

    def __init__(self, max_scopes: int = 256) -> None:
        if max_scopes < 1:
            raise ValueError(f"max_scopes must be >= 1, got {max_scopes}")
        self.max_scopes = max_scopes
        self._bitmaps: OrderedDict[ScopeKey, IdBitmap] = OrderedDict()
        self._generation = 0
        self._lock = threading.Lock()

    def allowed(self, session: Session, *, tenant: str, collection: str | None) -> IdBitmap:
        """The ready chunk ids of `tenant` (in `collection` when given), from the cache or read
        from `session` once."""
        key = (tenant, collection)
        with self._lock:
            cached = self._bitmaps.get(key)
            if cached is not None:
                self._bitmaps.move_to_end(key)
                return cached
            generation = self._generation
        bitmap = IdBitmap.from_ids(_scope_ids(session, tenant, collection))
        with self._lock:
            if self._generation == generation:
                self._bitmaps[key] = bitmap
                while len(self._bitmaps) > self.max_scopes:
                    self._bitmaps.popitem(last=False)
        return bitmap

    def note_ready(self, *, tenant: str, collection: str, chunk_ids: np.ndarray) -> None:
        """Record that `chunk_ids` became ready in (tenant, collection); call after the commit."""
        with self._lock:
            self._generation += 1
            for key in ((tenant, None), (tenant, collection)):
                if key in self._bitmaps:
                    self._bitmaps[key] = self._bitmaps[key].with_added(chunk_ids)

    def note_removed(self, chunk_ids: np.ndarray) -> None:
        """Record that `chunk_ids` are gone (whatever their scope); call after the commit."""
        with self._lock:
            self._generation += 1
            for key, bitmap in self._bitmaps.items():
                self._bitmaps[key] = bitmap.without(chunk_ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._bitmaps)

    @property
    def num_bytes(self) -> int:
        """Memory held by the cached bitmaps."""
        with self._lock:
            return sum(b.num_bytes for b in self._bitmaps.values())


def _scope_ids(session: Session, tenant: str, collection: str | None) -> np.ndarray:
    query = (
        select(Chunk.id)
        .join(Document)
        .join(Collection)
        .where(Document.status == "ready", Collection.tenant == tenant)
    )
    if collection is not None:
        query = query.where(Collection.name == collection)
    return np.fromiter(session.scalars(query), dtype=np.int64)
