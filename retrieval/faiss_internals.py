"""What VectorIndex reads from inside FAISS: GPU count, id selectors, the kind of an index and
the ids and vectors it stores (IVF lists included), over the untyped bindings."""

from __future__ import annotations

from typing import Any

import faiss as _faiss
import numpy as np

# NOTE: faiss's bundled stubs lack SearchParameters kwargs, DirectMap, HNSW params; use Any
faiss: Any = _faiss


def gpu_count() -> int:
    """How many GPUs FAISS can use: 0 for faiss-cpu builds or machines without CUDA."""
    get = getattr(faiss, "get_num_gpus", None)
    if get is None or not hasattr(faiss, "StandardGpuResources"):
        return 0
    try:
        return int(get())
    except RuntimeError:
        return 0


def id_selector(ids: np.ndarray) -> Any:
    """An IDSelectorBatch (hash set + Bloom filter) over `ids`."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return faiss.IDSelectorBatch(len(ids), faiss.swig_ptr(ids))


def index_kind_of(index: Any) -> str:
    """The kind ("ivf", "hnsw" or "flat") of an index VectorIndex built; IDMaps are seen through."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        return "ivf"
    if isinstance(index, faiss.IndexIDMap2 | faiss.IndexIDMap):
        index = faiss.downcast_index(index.index)
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(index, faiss.IndexFlat):
        return "flat"
    raise ValueError(f"unsupported FAISS index type {type(index).__name__}")


def ivf_ids(index: Any) -> np.ndarray:
    """Every id stored in the inverted lists of an IVF index."""
    return _ivf_lists(index, with_vectors=False)[0]


def stored_vectors(index: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [n], vectors float32 [n, d]) of every entry, for flat, HNSW or IVFFlat indexes."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        return _ivf_lists(index, with_vectors=True)
    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    if len(ids) == 0:
        return ids, np.zeros((0, index.d), dtype=np.float32)
    vectors = index.index.reconstruct_n(0, index.ntotal)
    return ids, np.asarray(vectors, dtype=np.float32).reshape(len(ids), index.d)


def _ivf_lists(index: Any, with_vectors: bool) -> tuple[np.ndarray, np.ndarray]:
    invlists = index.invlists
    id_parts = [np.zeros(0, dtype=np.int64)]
    vector_parts = [np.zeros((0, index.d), dtype=np.float32)]
    for list_no in range(index.nlist):
        size = invlists.list_size(list_no)
        if not size:
            continue
        id_parts.append(faiss.rev_swig_ptr(invlists.get_ids(list_no), size).astype(np.int64))
        if with_vectors:
            # IVFFlat codes are the raw float32 vectors
            raw = faiss.rev_swig_ptr(invlists.get_codes(list_no), size * invlists.code_size)
            vector_parts.append(np.frombuffer(raw.copy(), dtype=np.float32).reshape(size, index.d))
    return np.concatenate(id_parts), np.concatenate(vector_parts)
