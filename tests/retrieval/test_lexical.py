"""BM25 on SQLite FTS5 (Fts5Index): scores against a by-hand formula, filters, add/remove; the
analyzer, the stored-term formats and fusion."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.retrieval.fusion import rrf_fuse, rrf_scores
from prefixrag.retrieval.lexical.analyzer import Analyzer, light_stem
from prefixrag.retrieval.lexical.fts5_index import Fts5Index
from prefixrag.retrieval.lexical.terms import (
    MAX_TERM_BYTES,
    fts5_match,
    index_terms,
    tsvector_literal,
)

PLAIN = Analyzer(stop_words=False, stem=False, split_identifiers=False)
CORPUS = {
    10: "the cat sat on the mat",
    11: "the dog sat",
    12: "cat cat cat",
    13: "a bird in the hand",
    14: "zoo keeper",
    15: "x y z",
}


def reference_bm25(
    query: list[str],
    docs: dict[int, list[str]],
    k1: float = 1.2,
    b: float = 0.75,
    lucene_idf: bool = False,
) -> dict[int, float]:
    """FTS5's BM25, written out term by term for tiny corpora: idf = ln((N - df + 0.5) /
    (df + 0.5)) floored at 1e-6, a query term counted once per occurrence; only matching docs.
    `lucene_idf`: tantivy's (and Lucene's) idf, ln(1 + (N - df + 0.5) / (df + 0.5)), instead."""
    n = len(docs)
    avg = sum(len(d) for d in docs.values()) / n
    out = {}
    for doc_id, words in docs.items():
        total, matched = 0.0, False
        for term in query:
            tf = words.count(term)
            if tf == 0:
                continue
            matched = True
            df = sum(term in d for d in docs.values())
            ratio = (n - df + 0.5) / (df + 0.5)
            idf = math.log1p(ratio) if lucene_idf else max(math.log(ratio), 1e-6)
            total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(words) / avg))
        if matched:
            out[doc_id] = total
    return out


def reference_order(scores: dict[int, float]) -> list[int]:
    """Ids best first, ties by lower id."""
    return sorted(scores, key=lambda i: (-scores[i], i))


def plain_index(corpus: dict[int, str] = CORPUS) -> Fts5Index:
    index = Fts5Index(PLAIN)
    index.add(np.array(list(corpus)), list(corpus.values()))
    return index


def test_hand_computed_score() -> None:
    # "dog": df=1 of N=6, idf = ln(5.5/1.5); doc 11 has 3 words, avg length 22/6
    index = plain_index()
    scores, ids = index.search("dog", 5)
    expected = math.log(5.5 / 1.5) * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 3 / (22 / 6)))
    assert ids.tolist() == [11]
    assert scores[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "query", ["cat", "the cat sat", "cat cat dog", "bird hand mat zebra", "the", "zebra"]
)
def test_scores_and_order_match_reference(query: str) -> None:
    expected = reference_bm25(query.split(), {i: t.split() for i, t in CORPUS.items()})
    scores, ids = plain_index().search(query, 10)
    assert dict(zip(ids.tolist(), scores.tolist(), strict=True)) == pytest.approx(
        expected, rel=1e-5
    )
    assert ids.tolist() == reference_order(expected)


def test_filter_is_applied_inside_the_search() -> None:
    # the best match (12) is filtered out; k=1 must still return the best allowed one
    index = plain_index()
    _, ids = index.search("cat", 1, np.array([10, 11, 13]))
    assert ids.tolist() == [10]
    _, ids = index.search("cat", 5, np.array([11, 13]))
    assert ids.tolist() == []


def test_remove_equals_never_added() -> None:
    index = plain_index()
    assert index.remove(np.array([12, 99])) == 1
    rest = {i: t for i, t in CORPUS.items() if i != 12}
    fresh = plain_index(rest)
    for query in ("cat", "the sat", "hand"):
        got, want = index.search(query, 10), fresh.search(query, 10)
        assert got[1].tolist() == want[1].tolist()
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert index.ids().tolist() == [10, 11, 13, 14, 15]
    index.add(np.array([12]), [CORPUS[12]])
    assert plain_index().search("cat", 10)[1].tolist() == index.search("cat", 10)[1].tolist()


def test_bad_input_is_refused() -> None:
    index = plain_index()
    with pytest.raises(ValueError, match="already indexed"):
        index.add(np.array([5, 10]), ["x", "y"])
    assert 5 not in index.ids().tolist()  # nothing was added
    with pytest.raises(ValueError, match="2 ids for 1 texts"):
        index.add(np.array([1, 2]), ["x"])
    with pytest.raises(ValueError, match="already indexed or repeated"):
        index.add(np.array([1, 1]), ["x", "y"])
    with pytest.raises(ValueError, match="k must be"):
        index.search("cat", 0)


def test_concurrent_adds_and_searches() -> None:
    index = Fts5Index(PLAIN)

    def add_range(lo: int) -> None:
        for i in range(lo, lo + 200):
            index.add(np.array([i]), [f"word{i % 7} common"])
            index.search("common", 3)

    threads = [threading.Thread(target=add_range, args=(lo,)) for lo in (0, 200, 400)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(index) == 600
    assert len(index.search("word3", 1000)[1]) == len([i for i in range(600) if i % 7 == 3])


def test_terms_are_stored_verbatim() -> None:
    # identifiers, non-ASCII words and digits stay one token each: FTS5 splits at spaces only
    index = Fts5Index()
    index.add(np.array([1, 2, 3]), ["add_argument() parser", "naïve café", "x2 add"])
    assert index.search("add_argument", 5)[1].tolist() == [1, 3]  # 3 holds its part "add"
    assert index.search("argument", 5)[1].tolist() == [1]
    assert index.search("x2", 5)[1].tolist() == [3]
    assert index.search("café", 5)[1].tolist() == [2]
    assert index.search("cafe", 5)[1].tolist() == []  # no accent folding: as before
    assert index.search("the of and", 5)[1].tolist() == []  # only stop words: no terms
    long_word = "x" * (MAX_TERM_BYTES + 1)
    assert index_terms(PLAIN, f"a {long_word} b") == ["a", "b"]


def test_query_and_tsvector_formats() -> None:
    assert fts5_match(["cat", "add_argument", "cat"]) == '"cat" OR "add_argument" OR "cat"'
    assert tsvector_literal(["b", "a", "b"]) == "'b':1,2 'a':1"
    assert tsvector_literal(["z"] * 300).count(",") == 255  # PostgreSQL keeps 256 positions


def test_analyzer_splits_identifiers_drops_stop_words_and_stems() -> None:
    terms = Analyzer().terms("The add_argument() method appends Arguments to parsers")
    assert terms == ["add_argument", "add", "argument", "method", "append", "argument", "parser"]
    assert PLAIN.terms("The add_argument()") == ["the", "add_argument"]
    assert [light_stem(w) for w in ("iterables", "classes", "is", "matching", "sys", "x2s")] == [
        "iterable",
        "class",
        "is",
        "match",
        "sys",
        "x2s",
    ]


def test_rrf_order_by_hand() -> None:
    # k=0: a = 1/1 + 1/3, b = 1/2 + 1/1, c = 1/3, d = w/2 with w=1
    dense, lexical = [1, 2, 3], [2, 4, 1]
    scores = rrf_scores([dense, lexical], [1.0, 1.0], k=0)
    assert scores == pytest.approx({1: 1 + 1 / 3, 2: 1.5, 3: 1 / 3, 4: 0.5})
    assert rrf_fuse([dense, lexical], [1.0, 1.0], k=0) == [2, 1, 4, 3]
    # with weight 0 BM25 only appends its own ids after the dense order
    assert rrf_fuse([dense, lexical], [1.0, 0.0], k=0) == [1, 2, 3, 4]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), unique=True), st.lists(st.integers(0, 30), unique=True))
def test_rrf_is_a_permutation_of_the_union(a: list[int], b: list[int]) -> None:
    if not a and not b:
        return
    fused = rrf_fuse([a, b], [1.0, 1.0])
    assert sorted(fused) == sorted(set(a) | set(b))
    # a single ranking passes through unchanged
    assert rrf_fuse([a], [1.0]) == a


def test_rrf_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="repeats"):
        rrf_scores([[1, 1]], [1.0])
    with pytest.raises(ValueError, match="weights for"):
        rrf_scores([[1]], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        rrf_scores([], [])


@given(st.text(alphabet="ab_ cdeing sXY2.", max_size=60))
def test_term_counts_count_the_terms(text: str) -> None:
    analyzer = Analyzer()
    expected: dict[str, int] = {}
    for term in analyzer.terms(text):
        expected[term] = expected.get(term, 0) + 1
    assert analyzer.term_counts(text) == expected
