"""The tantivy BM25 index: scores and order match a hand computation (Lucene's idf), a chunk
added again replaces itself, removes and resets take chunks out, filters apply inside the query
(the k best allowed, never another collection's), and the index survives a reopen."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from tests.retrieval.test_lexical import reference_bm25, reference_order

# chunk id -> (document id, collection id, words); every chunk under 40 terms, where tantivy
# stores a length exactly
CORPUS = {
    1: (10, 1, "the cat sat on the mat"),
    2: (10, 1, "the dog sat"),
    3: (11, 1, "cat cat cat"),
    4: (12, 2, "a bird in the hand"),
    5: (12, 2, "zoo keeper"),
    6: (13, 2, "dog dog bird cat"),
}
QUERIES = ["cat", "the cat sat", "cat cat dog", "bird hand mat zebra", "the", "zebra"]


def fill(store: TantivyLexical, corpus: dict[int, tuple[int, int, str]] = CORPUS) -> None:
    store.add(
        list(corpus),
        [text.split() for _, _, text in corpus.values()],
        document_ids=[d for d, _, _ in corpus.values()],
        collection_ids=[c for _, c, _ in corpus.values()],
    )


def words(corpus: dict[int, tuple[int, int, str]] = CORPUS) -> dict[int, list[str]]:
    return {i: text.split() for i, (_, _, text) in corpus.items()}


def test_scores_and_order_match_hand_computed_bm25(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    fill(store)
    for query in QUERIES:
        expected = reference_bm25(query.split(), words(), lucene_idf=True)
        scores, ids = store.search(query.split(), 10)
        assert ids.tolist() == reference_order(expected), query
        got = dict(zip(ids.tolist(), scores.tolist(), strict=True))
        assert got == pytest.approx(expected, rel=1e-5), query
    # k cuts the same order
    expected = reference_order(reference_bm25(["cat"], words(), lucene_idf=True))
    assert store.search(["cat"], 2)[1].tolist() == expected[:2]


def test_adding_a_chunk_again_replaces_it(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    fill(store)
    store.add([3], [["zebra"]], document_ids=[11], collection_ids=[1])
    assert store.ids().tolist() == [1, 2, 3, 4, 5, 6]
    assert len(store) == 6
    assert store.search(["zebra"], 5)[1].tolist() == [3]
    assert 3 not in store.search(["cat"], 10)[1].tolist()


def test_remove_and_reset(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    fill(store)
    store.remove(np.array([1, 3, 99]))
    assert store.ids().tolist() == [2, 4, 5, 6]
    assert store.search(["cat"], 10)[1].tolist() == [6]
    store.reset()
    assert store.ids().tolist() == []
    assert store.search(["cat"], 10)[1].tolist() == []


def test_the_index_survives_a_reopen(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    fill(store)
    before = store.search(["cat", "dog"], 10)
    store.close()  # lets go of the writer's lock, as the app does at shutdown
    again = TantivyLexical(tmp_path / "lex")
    assert again.ids().tolist() == sorted(CORPUS)
    after = again.search(["cat", "dog"], 10)
    assert after[1].tolist() == before[1].tolist()
    np.testing.assert_array_equal(after[0], before[0])


def test_one_writer_at_a_time_and_readers_beside_it(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    fill(store)
    with pytest.raises(ValueError, match="LockBusy"):
        TantivyLexical(tmp_path / "lex")  # a second writer never touches the directory
    reader = TantivyLexical(tmp_path / "lex", writable=False)
    assert reader.ids().tolist() == sorted(CORPUS)
    with pytest.raises(RuntimeError, match="read-only"):
        reader.remove([1])
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.add([7], [["x"]], document_ids=[1], collection_ids=[1])


def test_bad_calls_are_refused(tmp_path: Path) -> None:
    store = TantivyLexical(tmp_path / "lex")
    with pytest.raises(ValueError, match="k must be"):
        store.search(["cat"], 0)
    with pytest.raises(ValueError, match="2 ids for 1 term lists"):
        store.add([1, 2], [["a"]], document_ids=[1, 1], collection_ids=[1, 1])
    fill(store)
    assert store.search([], 5)[1].tolist() == []
    assert store.search(["cat"], 5, collection_ids=[])[1].tolist() == []
    assert store.search(["cat"], 5, document_ids=[])[1].tolist() == []


VOCABULARY = ["cat", "dog", "bird", "mat", "sat", "the", "zoo"]
corpus_strategy = st.dictionaries(
    keys=st.integers(1, 200),
    values=st.tuples(
        st.integers(1, 6),  # document
        st.integers(1, 3),  # collection
        st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=8).map(" ".join),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    corpus=corpus_strategy,
    query=st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=3),
    collections=st.one_of(st.none(), st.lists(st.integers(1, 3), min_size=1, max_size=2)),
    documents=st.one_of(st.none(), st.lists(st.integers(1, 6), min_size=1, max_size=3)),
    k=st.integers(1, 30),
)
def test_a_filtered_search_never_leaks(
    tmp_path_factory: pytest.TempPathFactory,
    corpus: dict[int, tuple[int, int, str]],
    query: list[str],
    collections: list[int] | None,
    documents: list[int] | None,
    k: int,
) -> None:
    store = TantivyLexical(tmp_path_factory.mktemp("lex"))
    fill(store, corpus)
    allowed = {
        i
        for i, (doc, coll, _) in corpus.items()
        if (collections is None or coll in collections) and (documents is None or doc in documents)
    }
    scores, ids = store.search(query, k, collection_ids=collections, document_ids=documents)
    assert set(ids.tolist()) <= allowed
    # the filter is inside the query: the k best allowed, not the k best then filtered
    expected = reference_bm25(query, words(corpus), lucene_idf=True)
    best_allowed = sorted((s for i, s in expected.items() if i in allowed), reverse=True)[:k]
    assert scores.tolist() == pytest.approx(best_allowed, rel=1e-5)
