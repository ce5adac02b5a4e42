"""The vector search's allowed chunk ids (cached bitmaps per tenant and collection): after any mix
of reads, new ready documents and deletes, each scope holds exactly the ready chunks of that
tenant and collection (checked against a fresh SQL read and the test's own bookkeeping), and a
filtered FAISS search never returns another tenant's chunk."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services import scopes as scopes_module
from prefixrag.app.services.scopes import Scope, ScopeCache
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.vector_index import VectorIndex
from tests.app.test_lexical_search import Doc, docs_strategy, store

DIM = 8
TENANTS = ["a", "b", "c"]
SCOPES = [(t, c) for t in TENANTS for c in ("x", "y", None)]


def expected(placed: dict[int, tuple[int, Doc]], tenant: str, collection: str | None) -> set[int]:
    """The test's own answer: ready chunks of that tenant (and collection)."""
    return {
        chunk_id
        for chunk_id, (_, doc) in placed.items()
        if doc.status == "ready" and doc.tenant == tenant and collection in (None, doc.collection)
    }


def note_stored(scopes: ScopeCache, placed: dict[int, tuple[int, Doc]]) -> None:
    """What ingest tells the cache after committing each ready document."""
    by_document: dict[int, list[int]] = {}
    for chunk_id, (doc_id, doc) in placed.items():
        if doc.status == "ready":
            by_document.setdefault(doc_id, []).append(chunk_id)
    for doc_id, chunk_ids in by_document.items():
        doc = next(d for i, d in placed.values() if i == doc_id)
        scopes.note_ready(tenant=doc.tenant, collection=doc.collection, chunk_ids=chunk_ids)


def delete_documents(
    sessions: sessionmaker[Session], scopes: ScopeCache, placed: dict, doc_ids: set[int]
) -> None:
    """What IngestService.delete does: rows first (committed), then tell the cache."""
    gone = [chunk_id for chunk_id, (doc_id, _) in placed.items() if doc_id in doc_ids]
    with sessions() as session:
        session.execute(delete(Chunk).where(Chunk.document_id.in_(doc_ids)))
        session.execute(delete(Document).where(Document.id.in_(doc_ids)))
        session.commit()
    scopes.note_removed(np.asarray(gone, dtype=np.int64))
    for chunk_id in gone:
        del placed[chunk_id]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    first=docs_strategy,
    second=docs_strategy,
    warm=st.lists(st.sampled_from(SCOPES), max_size=6),
    num_deleted=st.integers(0, 4),
    query_seed=st.integers(0, 2**16),
)
def test_cached_scopes_stay_exact_and_never_leak(
    sessions: sessionmaker[Session],
    first: list[Doc],
    second: list[Doc],
    warm: list[tuple[str, str | None]],
    num_deleted: int,
    query_seed: int,
) -> None:
    with sessions() as session:  # each example starts empty (ids keep counting up)
        for model in (Chunk, Document, Collection):
            session.execute(delete(model))
        session.commit()
    scopes = ScopeCache(max_scopes=4)  # small: eviction and re-reads happen too
    placed = store(sessions, first)
    with sessions() as session:
        for tenant, collection in warm:  # some scopes cached before the changes below
            scopes.allowed(session, tenant=tenant, collection=collection)
    more = store(sessions, second)
    note_stored(scopes, more)
    placed |= more
    doc_ids = sorted({doc_id for doc_id, _ in placed.values()})
    delete_documents(sessions, scopes, placed, set(doc_ids[:num_deleted]))

    vectors = np.random.default_rng(query_seed).standard_normal((len(placed) + 1, DIM))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    ids = np.asarray(sorted(placed), dtype=np.int64)
    index = VectorIndex(DIM, use_gpu="no")
    index.add(ids, vectors[: len(ids)])
    query = vectors[-1:]
    for tenant, collection in SCOPES:
        truth = expected(placed, tenant, collection)
        with sessions() as session:
            cached = scopes.allowed(session, tenant=tenant, collection=collection)
            fresh = ScopeCache().allowed(session, tenant=tenant, collection=collection)
            resolved = Scope(tenant, collection).allowed_ids(session, scopes)
        assert set(cached.ids().tolist()) == truth == set(fresh.ids().tolist())
        # other tenants exist whenever this one is asked about, so a filter always applies
        if any(doc.tenant != tenant for _, doc in placed.values()) or collection is not None:
            assert isinstance(resolved, IdBitmap) and set(resolved.ids().tolist()) == truth
        # the FAISS search under the bitmap: only allowed ids, and the best of them
        _, found = index.search(query, 5, allowed_ids=cached)
        hits = [int(i) for i in found[0] if i >= 0]
        assert set(hits) <= truth
        keep = np.isin(ids, sorted(truth))
        best = ids[keep][np.argsort(-(vectors[: len(ids)][keep] @ query[0]), kind="stable")[:5]]
        assert hits == best.tolist()


def test_a_bitmap_read_during_a_change_is_not_kept(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that overlaps an ingest or delete serves its own search but is not cached (it may
    have missed the change); the next search reads again and keeps that."""
    placed = store(sessions, [Doc("a", "x", ("one", "two"))])
    scopes = ScopeCache()
    read = scopes_module._scope_ids

    def read_while_a_delete_lands(session: Session, tenant: str, collection: str | None):
        ids = read(session, tenant, collection)
        scopes.note_removed(np.asarray(sorted(placed)[:1]))
        return ids

    monkeypatch.setattr(scopes_module, "_scope_ids", read_while_a_delete_lands)
    with sessions() as session:
        assert set(scopes.allowed(session, tenant="a", collection=None).ids()) == set(placed)
    assert len(scopes) == 0
    monkeypatch.undo()
    with sessions() as session:
        scopes.allowed(session, tenant="a", collection=None)
    assert len(scopes) == 1


def test_the_cache_scope_is_public_only_over_the_stable_head_the_prompt_starts_with() -> None:
    scope = Scope("acme", "manuals", [3, 1])
    stable = [11, 12, 13]
    assert scope.cache_scope(stable, [11, 12, 13, 40, 41]) == CacheScope("acme", 3)
    # a prompt that does not start with the stable head shares nothing unsalted
    assert scope.cache_scope(stable, [11, 12, 99, 40]).num_public_tokens == 0
    assert scope.cache_scope(stable, [11, 12]).num_public_tokens == 0
    # a prompt still to be built on the head (the prefix peek), and a raw prompt with no head
    assert scope.cache_scope(stable).num_public_tokens == 3
    assert scope.cache_scope(()) == CacheScope("acme", 0)
    assert scope.document_ids == (3, 1) and hash(scope) == hash(Scope("acme", "manuals", (3, 1)))


def test_the_sql_filter_names_each_set_field_once() -> None:
    assert Scope().sql_filters() == ("", {})
    filters, params = Scope("acme", "manuals", [7]).sql_filters()
    assert filters.count(" AND ") == 3
    assert params == {"tenant": "acme", "collection": "manuals", "document_ids": [7]}
