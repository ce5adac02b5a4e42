"""VectorIndex against a numpy brute-force reference, plus persistence and IVF behaviour."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from prefixrag.retrieval import vector_index
from prefixrag.retrieval.faiss_internals import faiss
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.vector_index import VectorIndex

DIM = 24


def unit_vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force(queries: np.ndarray, ids: np.ndarray, vectors: np.ndarray, k: int) -> np.ndarray:
    scores = queries @ vectors.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order]


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.random.default_rng(1).permutation(100_000)[:500].astype(np.int64)
    return ids, unit_vectors(500, 2), unit_vectors(20, 3)


def test_exact_search_equals_brute_force(data) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, use_gpu="no")
    index.add(ids[:200], vectors[:200])
    index.add(ids[200:], vectors[200:])
    scores, found = index.search(queries, 10)
    np.testing.assert_array_equal(found, brute_force(queries, ids, vectors, 10))
    np.testing.assert_allclose(
        scores, np.sort(queries @ vectors.T, axis=1)[:, ::-1][:, :10], atol=1e-5
    )


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_filtered_search_equals_brute_force_over_subset(data, kind: str) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind=kind, nlist=8, nprobe=8, use_gpu="no", train_size=100)
    index.add(ids, vectors)
    allowed = ids[::7]
    _, found = index.search(queries, 5, allowed_ids=allowed)
    keep = np.isin(ids, allowed)
    np.testing.assert_array_equal(found, brute_force(queries, ids[keep], vectors[keep], 5))


def test_filter_smaller_than_k_pads(data) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, use_gpu="no")
    index.add(ids, vectors)
    scores, found = index.search(queries[:1], 5, allowed_ids=ids[:2])
    assert set(found[0, :2]) == set(ids[:2]) and (found[0, 2:] == -1).all()
    assert np.isneginf(scores[0, 2:]).all()
    _, none = index.search(queries[:1], 3, allowed_ids=np.array([], dtype=np.int64))
    assert (none == -1).all()
    _, empty = VectorIndex(DIM, use_gpu="no").search(queries[:1], 3)
    assert (empty == -1).all()


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_remove(data, kind: str) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind=kind, nlist=8, nprobe=8, use_gpu="no", train_size=100)
    index.add(ids, vectors)
    gone = ids[:250]
    assert index.remove(np.concatenate([gone, [10**9]])) == 250
    assert len(index) == 250 and set(index.ids()) == set(ids[250:])
    _, found = index.search(queries, 10)
    assert not np.isin(found, gone).any()
    np.testing.assert_array_equal(found, brute_force(queries, ids[250:], vectors[250:], 10))


def test_duplicate_and_bad_input(data) -> None:
    ids, vectors, _ = data
    index = VectorIndex(DIM, use_gpu="no")
    index.add(ids[:10], vectors[:10])
    with pytest.raises(ValueError, match="already"):
        index.add(ids[5:15], vectors[5:15])
    with pytest.raises(ValueError, match="duplicate"):
        index.add(np.array([7, 7]), vectors[:2])
    with pytest.raises(ValueError):
        index.add(ids[20:22], vectors[:2, :5])
    with pytest.raises(ValueError):
        index.search(vectors[:1], 0)
    with pytest.raises(ValueError):
        VectorIndex(DIM, kind="lsh")
    assert len(index) == 10


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_save_and_reopen_round_trip(tmp_path: Path, data, kind: str) -> None:
    ids, vectors, queries = data
    path = tmp_path / "sub" / "chunks.faiss"
    index = VectorIndex.open(path, DIM, kind=kind, nlist=8, nprobe=8, use_gpu="no", train_size=100)
    assert len(index) == 0
    index.add(ids, vectors)
    index.save()
    before = index.search(queries, 10)
    reopened = VectorIndex.open(path, DIM, kind=kind, nlist=8, nprobe=8, use_gpu="no")
    assert len(reopened) == len(ids) and set(reopened.ids()) == set(ids)
    after = reopened.search(queries, 10)
    np.testing.assert_array_equal(before[1], after[1])
    with pytest.raises(ValueError, match="dim"):
        VectorIndex.open(path, DIM + 1)
    # dim=None reads the file's own; the caller checks it once it knows what it wants
    own = VectorIndex.open(path, None, kind=kind, nlist=8, nprobe=8, use_gpu="no")
    assert own.dim == DIM and set(own.ids()) == set(ids)
    own.require_dim(DIM)
    with pytest.raises(ValueError, match=f"has dim {DIM}, expected {DIM + 1}"):
        own.require_dim(DIM + 1)


def test_failed_save_leaves_old_file_intact(tmp_path: Path, data, monkeypatch) -> None:
    ids, vectors, _ = data
    path = tmp_path / "chunks.faiss"
    index = VectorIndex(DIM, path=path, use_gpu="no")
    index.add(ids[:100], vectors[:100])
    index.save()
    old_bytes = path.read_bytes()
    index.add(ids[100:], vectors[100:])

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="injected"):
        index.save()
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert [p.name for p in tmp_path.iterdir()] == ["chunks.faiss"]  # no temp file left behind
    assert len(VectorIndex.open(path, DIM, use_gpu="no")) == 100


def test_ivf_is_flat_until_trained_then_approximates(data) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind="ivf", nlist=16, nprobe=16, use_gpu="no", train_size=300)
    index.add(ids[:299], vectors[:299])
    assert not index.is_trained_ivf
    _, found = index.search(queries, 10)
    np.testing.assert_array_equal(found, brute_force(queries, ids[:299], vectors[:299], 10))
    index.add(ids[299:], vectors[299:])
    assert index.is_trained_ivf and len(index) == len(ids)
    # nprobe == nlist visits every list, so IVF search is exact again
    _, found = index.search(queries, 10)
    np.testing.assert_array_equal(found, brute_force(queries, ids, vectors, 10))
    np.testing.assert_allclose(index.reconstruct(ids[:3]), vectors[:3], atol=1e-6)


def test_reset(data) -> None:
    ids, vectors, _ = data
    index = VectorIndex(DIM, use_gpu="no")
    index.add(ids, vectors)
    index.reset()
    assert len(index) == 0
    index.add(ids[:5], vectors[:5])
    assert len(index) == 5


def _centroids(index: VectorIndex) -> np.ndarray:
    ivf = faiss.downcast_index(index._index)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def test_trained_ivf_takes_new_vectors_without_retraining(tmp_path: Path, data) -> None:
    ids, vectors, queries = data
    path = tmp_path / "chunks.faiss"
    index = VectorIndex(DIM, path=path, kind="ivf", nlist=16, nprobe=16, use_gpu="no",
                        train_size=200)  # fmt: skip
    index.add(ids[:250], vectors[:250])
    assert index.is_trained_ivf
    centroids = _centroids(index)
    index.add(ids[250:400], vectors[250:400])
    index.save()
    reopened = VectorIndex.open(path, DIM, kind="ivf", nlist=16, nprobe=16, use_gpu="no",
                                train_size=200)  # fmt: skip
    reopened.add(ids[400:], vectors[400:])
    # the lists were trained once: the clusters the first 250 made are the ones in use
    np.testing.assert_array_equal(_centroids(reopened), centroids)
    assert len(reopened) == len(ids)
    _, found = reopened.search(queries, 10)  # nprobe == nlist: exact over every vector
    np.testing.assert_array_equal(found, brute_force(queries, ids, vectors, 10))
    # each later vector is its own nearest neighbour, so it sits in a list a search reaches
    _, self_hits = reopened.search(vectors[400:], 1)
    np.testing.assert_array_equal(self_hits[:, 0], ids[400:])


def test_a_small_scope_of_a_trained_ivf_is_searched_exactly(
    data, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, vectors, queries = data
    # one list of 16 probed: a filtered IVF search alone would miss most of the scope
    index = VectorIndex(DIM, kind="ivf", nlist=16, nprobe=1, use_gpu="no", train_size=300)
    index.add(ids, vectors)
    assert index.is_trained_ivf
    scope = ids[::5]
    keep = np.isin(ids, scope)
    expected = brute_force(queries, ids[keep], vectors[keep], 10)
    for allowed in (scope, IdBitmap.from_ids(scope)):
        scores, found = index.search(queries, 10, allowed_ids=allowed)
        np.testing.assert_array_equal(found, expected)
        np.testing.assert_allclose(
            scores, np.sort(queries @ vectors[keep].T, axis=1)[:, ::-1][:, :10], atol=1e-5
        )
    # an id with no vector (a row indexed since) leaves it to the IVF search: no error
    _, found = index.search(queries, 10, allowed_ids=np.append(scope, 10**7))
    assert set(found.ravel().tolist()) <= set(scope.tolist()) | {-1}
    # past the size limit the IVF search runs, and with one list probed it misses neighbours
    monkeypatch.setattr(vector_index, "EXACT_SCOPE_MAX_IDS", len(scope) - 1)
    _, found = index.search(queries, 10, allowed_ids=scope)
    assert not np.array_equal(found, expected)
