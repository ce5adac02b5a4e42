"""IdBitmap against a Python set, and as a FAISS filter against an id-array filter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.vector_index import VectorIndex

id_lists = st.lists(st.integers(0, 2000), max_size=60)


@given(first=id_lists, added=id_lists, removed=id_lists)
def test_matches_a_set(first: list[int], added: list[int], removed: list[int]) -> None:
    start = IdBitmap.from_ids(np.asarray(first))
    bitmap = start.with_added(np.asarray(added)).without(np.asarray(removed))
    expected = (set(first) | set(added)) - set(removed)
    assert bitmap.ids().tolist() == sorted(expected)
    assert len(bitmap) == len(expected) and bitmap.is_empty == (not expected)
    assert all(i in bitmap for i in expected)
    assert not any(i in bitmap for i in set(removed) | {-1, 10**9})
    assert start.ids().tolist() == sorted(set(first))  # updates never change the original


def test_negative_ids_are_refused() -> None:
    with pytest.raises(ValueError):
        IdBitmap.from_ids(np.asarray([3, -1]))


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_filters_a_search_like_an_id_array(kind: str) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = rng.permutation(5000)[:400].astype(np.int64)
    index = VectorIndex(16, kind=kind, nlist=8, nprobe=8, use_gpu="no", train_size=100)
    index.add(ids, vectors)
    allowed = ids[::5]
    queries = vectors[:12]
    by_array = index.search(queries, 7, allowed_ids=allowed)
    by_bitmap = index.search(queries, 7, allowed_ids=IdBitmap.from_ids(allowed))
    np.testing.assert_array_equal(by_bitmap[1], by_array[1])
    assert np.isin(by_bitmap[1], allowed).all()
    empty = index.search(queries, 7, allowed_ids=IdBitmap())
    assert (empty[1] == -1).all()
