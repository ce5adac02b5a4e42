"""A request's scope: what it may see (Scope), and the chunk ids of each tenant's scopes as cached
bitmaps kept current by ingest (ScopeCache).

Scope is made once per request from the tenant, the collection and the document filter, and
everything downstream is derived from it: the vector search's id set (allowed_ids), the lexical
search's SQL filter (sql_filters) or tantivy's collection filter (collection_ids), and the
engine's CacheScope (cache_scope), whose public head is the prompt's stable part.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.retrieval.id_bitmap import IdBitmap

# a cached bitmap's key: (tenant, collection name, or None for the whole tenant)
_BitmapKey = tuple[str, str | None]


@dataclass(slots=True, frozen=True)
class Scope:
    """What one request may see: the chunks of ready documents of `tenant` (every tenant's when
    None), in `collection` (any when None), among `document_ids` (any when None)."""

    tenant: str | None = None
    collection: str | None = None
    document_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.document_ids is not None:  # any sequence in; a tuple kept, so a Scope hashes
            object.__setattr__(self, "document_ids", tuple(int(i) for i in self.document_ids))

    def allowed_ids(self, session: Session, cache: ScopeCache) -> IdBitmap | np.ndarray | None:
        """The ready chunk ids in scope, or None when nothing needs filtering (no filter, and
        no other tenant has collections).

        A tenant or collection scope is a cached bitmap (no ids are loaded per query); a
        document filter reads only those documents' chunk ids.
        """
        tenant, collection = self.tenant, self.collection
        if tenant is None and collection is None and self.document_ids is None:
            return None
        # a document filter, or no tenant (the CLI's all-tenants view, every tenant's collection
        # of that name): read those ids
        if self.document_ids is not None or tenant is None:
            return _ready_chunk_ids(session, self)
        if collection is None and not _has_other_tenants(session, tenant):
            return None
        return cache.allowed(session, tenant=tenant, collection=collection)

    def sql_filters(self) -> tuple[str, dict[str, Any]]:
        """`AND ...` conditions on the `collections` and `documents` tables of a query that joins
        them, with their bound parameters."""
        filters = ""
        params: dict[str, Any] = {}
        if self.tenant is not None:
            filters += " AND collections.tenant = :tenant"
            params["tenant"] = self.tenant
        if self.collection is not None:
            filters += " AND collections.name = :collection"
            params["collection"] = self.collection
        if self.document_ids is not None:
            # an expanding parameter: SQLAlchemy writes an empty list as a never-true IN
            filters += " AND documents.id IN :document_ids"
            params["document_ids"] = list(self.document_ids)
        return filters, params

    def collection_ids(self, session: Session) -> list[int] | None:
        """The ids of the collections the tenant and collection name select, None for all."""
        if self.tenant is None and self.collection is None:
            return None
        query = select(Collection.id)
        if self.tenant is not None:
            query = query.where(Collection.tenant == self.tenant)
        if self.collection is not None:
            query = query.where(Collection.name == self.collection)
        return [int(i) for i in session.scalars(query)]

    def cache_scope(
        self, stable_ids: Sequence[int], prompt_ids: Sequence[int] | None = None
    ) -> CacheScope:
        """The engine's scope for a prompt: its stable head (system prompt, tools, examples), the
        same for every tenant, is cached unsalted, and the rest under the tenant's salt. The head
        is public only where `prompt_ids` starts with `stable_ids` (None: a prompt still to be
        built on them); a raw prompt passes no stable ids, so all of it is the tenant's."""
        head = list(stable_ids)
        public = len(head) if prompt_ids is None or list(prompt_ids[: len(head)]) == head else 0
        return CacheScope(namespace=self.tenant or "", num_public_tokens=public)


class ScopeCache:
    """The ready chunk ids of each (tenant, collection) scope as IdBitmaps, least recently used
    first out past `max_scopes` (each holds max chunk id / 8 bytes). Thread-safe."""

    def __init__(self, max_scopes: int = 256) -> None:
        if max_scopes < 1:
            raise ValueError(f"max_scopes must be >= 1, got {max_scopes}")
        self.max_scopes = max_scopes
        self._bitmaps: OrderedDict[_BitmapKey, IdBitmap] = OrderedDict()
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


def _ready_chunk_ids(session: Session, scope: Scope) -> np.ndarray:
    query = select(Chunk.id).join(Document).join(Collection).where(Document.status == "ready")
    if scope.tenant is not None:
        query = query.where(Collection.tenant == scope.tenant)
    if scope.collection is not None:
        query = query.where(Collection.name == scope.collection)
    if scope.document_ids is not None:
        query = query.where(Document.id.in_(scope.document_ids))
    return np.fromiter(session.scalars(query), dtype=np.int64)


def _has_other_tenants(session: Session, tenant: str) -> bool:
    other = select(Collection.id).where(Collection.tenant != tenant).limit(1)
    return session.scalar(other) is not None
