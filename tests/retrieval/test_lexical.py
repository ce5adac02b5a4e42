"""BM25 index: scores against a by-hand formula, filters, add/remove, analyzer and fusion."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.retrieval.analyzer import Analyzer, light_stem
from prefixrag.retrieval.fusion import rrf_fuse, rrf_scores
from prefixrag.retrieval.lexical import BM25Params, LexicalIndex

PLAIN = Analyzer(stop_words=False, stem=False, split_identifiers=False)
CORPUS = {
    10: "the cat sat on the mat",
    11: "the dog sat",
    12: "cat cat cat",
    13: "a bird in the hand",
}


def reference_bm25(query: list[str], docs: dict[int, list[str]], k1: float, b: float) -> dict:
    """Okapi BM25 with Lucene's idf, written out term by term for tiny corpora."""
    n = len(docs)
    avg = sum(len(d) for d in docs.values()) / n
    out = {}
    for doc_id, words in docs.items():
        total = 0.0
        for term in query:
            tf = words.count(term)
            if tf == 0:
                continue
            df = sum(term in d for d in docs.values())
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(words) / avg))
        out[doc_id] = total
    return out


def plain_index(corpus: dict[int, str] = CORPUS, **kwargs: float) -> LexicalIndex:
    index = LexicalIndex(PLAIN, BM25Params(**kwargs))
    index.add(np.array(list(corpus)), list(corpus.values()))
    return index


def test_hand_computed_score() -> None:
    # "dog": df=1 of N=4, idf = ln(1 + 3.5/1.5); doc 11 has 3 words, avg length 17/4
    index = plain_index()
    scores, ids = index.search("dog", 5)
    expected = math.log(1 + 3.5 / 1.5) * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 3 / (17 / 4)))
    assert ids.tolist() == [11]
    assert scores[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("k1,b", [(1.2, 0.75), (2.0, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("query", ["cat", "the cat sat", "cat cat dog", "bird hand mat zebra"])
def test_scores_match_reference(query: str, k1: float, b: float) -> None:
    index = plain_index(k1=k1, b=b)
    expected = reference_bm25(query.split(), {i: t.split() for i, t in CORPUS.items()}, k1, b)
    scores, ids = index.search(query, 10)
    assert dict(zip(ids.tolist(), scores.tolist(), strict=True)) == pytest.approx(
        {i: s for i, s in expected.items() if s > 0}, rel=1e-5
    )
    assert list(scores) == sorted(scores, reverse=True)


def test_filter_is_applied_inside_the_search() -> None:
    # the best match (12) is filtered out; k=1 must still return the best allowed one
    index = plain_index()
    _, ids = index.search("cat", 1, allowed_ids=np.array([10, 11, 13]))
    assert ids.tolist() == [10]
    _, ids = index.search("cat", 5, allowed_ids=np.array([11, 13]))
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
    assert index.ids().tolist() == [10, 11, 13]
    index.add(np.array([12]), [CORPUS[12]])  # the freed slot is reused
    assert plain_index().search("cat", 10)[1].tolist() == index.search("cat", 10)[1].tolist()


def test_bad_input_is_refused() -> None:
    index = plain_index()
    with pytest.raises(ValueError, match="already indexed"):
        index.add(np.array([5, 10]), ["x", "y"])
    assert 5 not in index.ids().tolist()  # nothing was added
    with pytest.raises(ValueError, match="2 ids for 1 texts"):
        index.add(np.array([1, 2]), ["x"])
    with pytest.raises(ValueError, match="unique"):
        index.add(np.array([1, 1]), ["x", "y"])
    with pytest.raises(ValueError, match="k must be"):
        index.search("cat", 0)
    with pytest.raises(ValueError, match="b must be"):
        BM25Params(b=1.5)


def test_concurrent_adds_and_searches() -> None:
    index = LexicalIndex(PLAIN)

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
