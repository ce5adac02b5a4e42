"""BM25 inside the database (SQLite FTS5; PostgreSQL tsvector + GIN when the suite has one): the
rank order and scores match a hand computation, deletes take the terms with the rows, migration
0004 backfills existing chunks, and a scoped search never returns another tenant's chunk."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select, text
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.lexical import insert_chunk_terms
from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services.index_sync import fail_interrupted
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.lexical.analyzer import Analyzer
from tests.retrieval.test_lexical import reference_bm25, reference_order

PLAIN = Analyzer(stop_words=False, stem=False, split_identifiers=False)


@dataclass(slots=True, frozen=True)
class Doc:
    """A document to store: where it belongs, its status, its chunks' texts."""

    tenant: str
    collection: str
    texts: tuple[str, ...]
    status: str = "ready"


def store(sessions: sessionmaker[Session], docs: list[Doc]) -> dict[int, tuple[int, Doc]]:
    """Write `docs` as ingest does (chunk rows and their terms in one transaction); returns each
    chunk id's (document id, Doc)."""
    placed: dict[int, tuple[int, Doc]] = {}
    with sessions() as session:
        # collections stored by an earlier call are reused (a store may be called again)
        collections = {(c.tenant, c.name): c for c in session.scalars(select(Collection))}
        for n, doc in enumerate(docs):
            key = (doc.tenant, doc.collection)
            if key not in collections:
                collections[key] = Collection(tenant=doc.tenant, name=doc.collection)
            row = Document(
                collection=collections[key],
                title=f"d{n}",
                filename=None,
                media_type="text/plain",
                num_bytes=1,
                sha256=uuid.uuid4().hex * 2,  # unique, so a later store never clashes
                status=doc.status,
                meta={},
            )
            session.add(row)
            session.flush()
            chunks = [
                Chunk(
                    document_id=row.id,
                    ordinal=i,
                    text=t,
                    char_start=0,
                    char_end=len(t),
                    num_tokens=1,
                )
                for i, t in enumerate(doc.texts)
            ]
            session.add_all(chunks)
            session.flush()
            insert_chunk_terms(session, PLAIN, [c.id for c in chunks], list(doc.texts))
            placed |= {c.id: (row.id, doc) for c in chunks}
        session.commit()
    return placed


def chunk_texts(sessions: sessionmaker[Session]) -> dict[int, list[str]]:
    """Every chunk row's words (the reference corpus: BM25 statistics span all rows)."""
    with sessions() as session:
        return {i: t.split() for i, t in session.execute(select(Chunk.id, Chunk.text)).all()}


CORPUS = [
    Doc("t", "c", ("the cat sat on the mat", "the dog sat", "cat cat cat")),
    Doc("t", "c", ("a bird in the hand", "zoo keeper", "x y z", "dog dog bird cat")),
]
QUERIES = ["cat", "the cat sat", "cat cat dog", "bird hand mat zebra", "the", "zebra"]


def test_rank_order_and_scores_match_hand_computed_bm25(
    sessions: sessionmaker[Session],
) -> None:
    store(sessions, CORPUS)
    lexical = DatabaseLexicalIndex(sessions, PLAIN)
    docs = chunk_texts(sessions)
    for query in QUERIES:
        expected = reference_bm25(query.split(), docs)
        scores, ids = lexical.search(query, 10)
        assert ids.tolist() == reference_order(expected), query
        got = dict(zip(ids.tolist(), scores.tolist(), strict=True))
        assert got == pytest.approx(expected, rel=1e-5), query
    # k cuts the same order
    assert (
        lexical.search("cat", 2)[1].tolist() == reference_order(reference_bm25(["cat"], docs))[:2]
    )


def test_deletes_take_the_terms_with_the_rows(sessions: sessionmaker[Session]) -> None:
    placed = store(sessions, [*CORPUS, Doc("t", "c", ("cat stuck",), status="processing")])
    lexical = DatabaseLexicalIndex(sessions, PLAIN)
    assert lexical.ids().tolist() == sorted(placed)
    first_doc = placed[min(placed)][0]
    with sessions() as session:  # as IngestService.delete does
        session.execute(delete(Chunk).where(Chunk.document_id == first_doc))
        session.execute(delete(Document).where(Document.id == first_doc))
        session.commit()
    assert fail_interrupted(sessions=sessions) == 1  # deletes the processing doc's chunks
    remaining = chunk_texts(sessions)
    assert lexical.ids().tolist() == sorted(remaining)
    # the statistics follow too: scores equal a corpus that never held the deleted rows
    for query in QUERIES:
        expected = reference_bm25(query.split(), remaining)
        scores, ids = lexical.search(query, 10)
        assert ids.tolist() == reference_order(expected)
        assert dict(zip(ids.tolist(), scores.tolist(), strict=True)) == pytest.approx(
            expected, rel=1e-5
        )


def test_a_rolled_back_ingest_leaves_no_terms(sessions: sessionmaker[Session]) -> None:
    store(sessions, CORPUS[:1])
    with sessions() as session:
        doc = session.scalars(select(Document)).one()
        chunk = Chunk(
            document_id=doc.id, ordinal=99, text="zebra", char_start=0, char_end=5, num_tokens=1
        )
        session.add(chunk)
        session.flush()
        insert_chunk_terms(session, PLAIN, [chunk.id], ["zebra"])
        session.rollback()
    lexical = DatabaseLexicalIndex(sessions, PLAIN)
    assert lexical.search("zebra", 5)[1].tolist() == []
    assert lexical.ids().tolist() == sorted(chunk_texts(sessions))


def test_migration_backfills_existing_chunks(database_url: str) -> None:
    upgrade_db(database_url, "0003_chunk_ids_never_reused")
    engine = make_engine(database_url)
    try:
        _insert_raw_chunks(engine, {1: ("add_argument appends Options", None), 2: ("horses", "H")})
        upgrade_db(database_url)
        lexical = DatabaseLexicalIndex(make_sessionmaker(engine))  # the service's analyzer
        assert lexical.ids().tolist() == [1, 2]
        assert lexical.search("argument option", 5)[1].tolist() == [1]  # split and stemmed
        assert lexical.search("horse", 5)[1].tolist() == [2]
        assert lexical.search("h", 5)[1].tolist() == [2]  # the heading is indexed
    finally:
        engine.dispose()


def _insert_raw_chunks(engine: Engine, chunks: dict[int, tuple[str, str | None]]) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO collections (id, tenant, name, created_at) "
                "VALUES (1, 't', 'c', CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO documents (id, collection_id, title, media_type, num_bytes, sha256,"
                " status, metadata, created_at, updated_at) VALUES (1, 1, 'd', 'text/plain', 1,"
                " 'x', 'ready', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            )
        )
        for chunk_id, (body, heading) in chunks.items():
            conn.execute(
                text(
                    "INSERT INTO chunks (id, document_id, ordinal, text, char_start, char_end,"
                    " num_tokens, heading) VALUES (:id, 1, :id, :body, 0, 1, 1, :heading)"
                ),
                {"id": chunk_id, "body": body, "heading": heading},
            )


VOCABULARY = ["alpha", "beta", "gamma", "delta"]
docs_strategy = st.lists(
    st.builds(
        Doc,
        tenant=st.sampled_from(["a", "b", "c"]),
        collection=st.sampled_from(["x", "y"]),
        texts=st.lists(
            st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=5).map(" ".join),
            min_size=1,
            max_size=3,
        ).map(tuple),
        status=st.sampled_from(["ready", "ready", "failed"]),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    docs=docs_strategy,
    query=st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=3).map(" ".join),
    tenant=st.sampled_from(["a", "b", "c", None]),
    collection=st.sampled_from(["x", "y", None]),
    k=st.integers(1, 30),
)
def test_a_scoped_search_never_leaks(
    sessions: sessionmaker[Session],
    docs: list[Doc],
    query: str,
    tenant: str | None,
    collection: str | None,
    k: int,
) -> None:
    with sessions() as session:  # each example starts empty
        for model in (Chunk, Document, Collection):
            session.execute(delete(model))
        session.commit()
    placed = store(sessions, docs)
    allowed = {
        chunk_id
        for chunk_id, (_, doc) in placed.items()
        if doc.status == "ready"
        and tenant in (None, doc.tenant)
        and collection in (None, doc.collection)
    }
    scores, ids = DatabaseLexicalIndex(sessions, PLAIN).search(query, k, Scope(tenant, collection))
    assert set(ids.tolist()) <= allowed
    # and the filter is inside the query: the k best allowed, not the k best then filtered
    expected = reference_bm25(query.split(), chunk_texts(sessions))
    best_allowed = sorted((s for i, s in expected.items() if i in allowed), reverse=True)[:k]
    assert sorted(scores.tolist(), reverse=True) == pytest.approx(best_allowed, rel=1e-5)
    some_doc = next(iter(placed.values()))[0]
    _, ids = DatabaseLexicalIndex(sessions, PLAIN).search(
        query, k, Scope(tenant, collection, [some_doc])
    )
    assert {placed[i][0] for i in ids.tolist()} <= {some_doc}
    assert set(ids.tolist()) <= allowed
