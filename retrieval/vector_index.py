"""A persisted, deletable FAISS index of chunk vectors (inner product on unit vectors)."""

from __future__ import annotations

import glob
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from prefixrag.retrieval.faiss_internals import (
    faiss,
    gpu_count,
    id_selector,
    index_kind_of,
    ivf_ids,
    stored_vectors,
)
from prefixrag.retrieval.id_bitmap import IdBitmap

logger = logging.getLogger(__name__)

INDEX_KINDS = ("flat", "ivf", "hnsw")
_HNSW_M = 32
_HNSW_EF_SEARCH = 64
_TRAIN_POINTS_PER_LIST = 64
_PAD_SCORE = -np.inf
# A filtered IVF search scans nprobe lists and keeps the allowed vectors in them: for a scope of
# 1% of a million chunks that is too few, and recall@10 falls to 0.91 at nprobe 64
# (bench/ann_bench.py). Up to this many allowed ids, their vectors are scored exactly instead:
# about 2 ms per thousand ids here (FAISS's reconstruct by id, then one matmul), so up to the
# time of the IVF search itself.
EXACT_SCOPE_MAX_IDS = 16_384


class VectorIndex:
    """Chunk vectors keyed by int64 ids, searched by inner product, saved atomically to `path`.

    kind="flat" is exact (IndexIDMap2 over IndexFlatIP). kind="ivf" stays flat (exact) until it
    holds `train_size` vectors (default 39 * nlist, FAISS's own minimum), then trains an
    IndexIVFFlat and searches `nprobe` lists. kind="hnsw" is an HNSW graph; removing from it
    rebuilds the graph. Filtered search runs inside FAISS through an IDSelector. With
    use_gpu="auto" (or "yes") unfiltered searches run on a GPU copy when faiss-gpu sees one.
    Every method takes one internal lock, so the index may be shared between threads.
    """

    def __init__(
        self,
        dim: int,
        path: Path | None = None,
        kind: str = "flat",
        nlist: int = 1024,
        nprobe: int = 32,
        use_gpu: str = "auto",
        train_size: int | None = None,
        ef_search: int = _HNSW_EF_SEARCH,
    ) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if kind not in INDEX_KINDS:
            raise ValueError(f"kind must be one of {INDEX_KINDS}, got {kind!r}")
        if nlist < 1 or nprobe < 1 or ef_search < 1:
            raise ValueError(f"nlist, nprobe, ef_search must be >= 1: {nlist} {nprobe} {ef_search}")
        if use_gpu not in ("auto", "yes", "no"):
            raise ValueError(f"use_gpu must be 'auto', 'yes' or 'no', got {use_gpu!r}")
        if use_gpu == "yes" and gpu_count() == 0:
            raise ValueError("use_gpu='yes' but faiss has no GPU support or sees no GPU")
        self.dim = dim
        self.path = Path(path) if path is not None else None
        self.kind = kind
        self.nlist = nlist
        self.nprobe = nprobe
        self.ef_search = ef_search
        self.train_size = train_size if train_size is not None else 39 * nlist
        if self.train_size < nlist:
            raise ValueError(f"train_size ({self.train_size}) must be >= nlist ({nlist})")
        self.use_gpu = use_gpu != "no" and gpu_count() > 0
        self._lock = threading.RLock()
        self._index: Any = self._empty()
        self._gpu_index: Any = None
        self._gpu_resources: Any = None

    @classmethod
    def open(cls, path: Path, dim: int | None, **kwargs: Any) -> VectorIndex:
        """The index saved at `path`, or an empty one if there is no file yet. dim=None takes
        the file's own dim (the file must exist); callers check it later with `require_dim`."""
        path = Path(path)
        if dim is None:
            loaded = faiss.read_index(str(path))
            index = cls(loaded.d, path=path, **kwargs)
            index._adopt(loaded, path)
            return index
        index = cls(dim, path=path, **kwargs)
        if path.exists():
            index._adopt(faiss.read_index(str(path)), path)
        return index

    # state

    @property
    def is_trained_ivf(self) -> bool:
        """True once kind="ivf" has trained its clusters (before that it searches exactly)."""
        return index_kind_of(self._index) == "ivf"

    def require_dim(self, dim: int) -> None:
        """Raise ValueError unless this index holds vectors of `dim` dimensions."""
        if self.dim != dim:
            raise ValueError(f"index file {self.path} has dim {self.dim}, expected {dim}")

    def __len__(self) -> int:
        with self._lock:
            return int(self._index.ntotal)

    def ids(self) -> np.ndarray:
        """Every stored id (int64, in no particular order)."""
        with self._lock:
            if self.is_trained_ivf:
                return ivf_ids(self._index)
            return faiss.vector_to_array(self._index.id_map).astype(np.int64)

    # writes

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Store `vectors` (float32 [n, dim]) under `ids` (int64 [n]); a known id is an error."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        vectors = self._as_matrix(vectors, "vectors")
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids but {len(vectors)} vectors")
        if len(ids) == 0:
            return
        if len(np.unique(ids)) != len(ids):
            raise ValueError("duplicate ids within one add")
        if (ids < 0).any():
            raise ValueError("ids must be >= 0 (-1 marks padding in search results)")
        with self._lock:
            clash = ids[np.isin(ids, self.ids())]
            if len(clash):
                raise ValueError(f"ids already in the index: {clash[:10].tolist()}")
            self._index.add_with_ids(vectors, ids)
            self._gpu_index = None
            if self.kind == "ivf" and not self.is_trained_ivf and len(self) >= self.train_size:
                self._train_ivf()

    def remove(self, ids: np.ndarray) -> int:
        """Delete `ids` (unknown ones are ignored); returns how many were removed."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return 0
        with self._lock:
            self._gpu_index = None
            if index_kind_of(self._index) == "hnsw":
                return self._remove_by_rebuild(ids)
            if index_kind_of(self._index) == "ivf":
                # NOTE: the IVF hashtable direct map accepts only an IDSelectorArray; it points
                # into `ids`, which stays alive for the call
                return int(
                    self._index.remove_ids(faiss.IDSelectorArray(len(ids), faiss.swig_ptr(ids)))
                )
            return int(self._index.remove_ids(id_selector(ids)))

    def reset(self) -> None:
        """Empty the index (the file on disk changes only at the next save)."""
        with self._lock:
            self._index = self._empty()
            self._gpu_index = None

    def save(self) -> None:
        """Write the index to `path` atomically: a temp file in the same dir, fsync, rename."""
        if self.path is None:
            raise ValueError("this index has no path to save to")
        with self._lock:
            blob = faiss.serialize_index(self._index)
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(self.path), dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, self.path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_dir(directory)

    # reads

    def search(
        self, queries: np.ndarray, k: int, allowed_ids: np.ndarray | IdBitmap | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k best ids per query and their scores, best first, as [nq, k] arrays.

        Missing results are padded with id -1 and score -inf. With `allowed_ids` (an id array,
        or an IdBitmap, which costs nothing to apply) only those ids can be returned; the filter
        runs inside the FAISS search.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        queries = self._as_matrix(queries, "queries")
        pad = (
            np.full((len(queries), k), _PAD_SCORE, dtype=np.float32),
            np.full((len(queries), k), -1, dtype=np.int64),
        )
        allowed = allowed_ids
        if allowed is not None and not isinstance(allowed, IdBitmap):
            allowed = np.asarray(allowed, dtype=np.int64)
        if len(queries) == 0 or (allowed is not None and _is_empty(allowed)):
            return pad
        with self._lock:
            if len(self) == 0:
                return pad
            exact = self._search_scope_exactly(queries, k, allowed)
            if exact is not None:
                return exact
            params = self._search_params(k, allowed)
            target = self._index if allowed is not None else self._searcher()
            scores, ids = target.search(queries, k, params=params)
        scores = np.where(ids < 0, _PAD_SCORE, scores).astype(np.float32)
        return scores, ids.astype(np.int64)

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """The stored vectors of `ids` (float32 [n, dim]); an unknown id raises ValueError."""
        with self._lock:
            stored_ids, vectors = stored_vectors(self._index)
        where = {int(i): row for row, i in enumerate(stored_ids)}
        wanted = np.asarray(ids, dtype=np.int64).reshape(-1)
        missing = [int(i) for i in wanted if int(i) not in where]
        if missing:
            raise ValueError(f"ids not in the index: {missing[:10]}")
        return vectors[[where[int(i)] for i in wanted]]

    # internals

    def _search_scope_exactly(
        self, queries: np.ndarray, k: int, allowed: np.ndarray | IdBitmap | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """An IVF search within a small scope, scored over every allowed vector (see
        EXACT_SCOPE_MAX_IDS); None when the scope is large, absent, or holds an id without a
        vector (a row indexed since, or a repair pending), which the IVF search handles."""
        if allowed is None or index_kind_of(self._index) != "ivf":
            return None
        if len(allowed) > EXACT_SCOPE_MAX_IDS:
            return None
        scope = allowed.ids() if isinstance(allowed, IdBitmap) else np.unique(allowed)
        try:
            vectors = self._index.reconstruct_batch(scope)
        except RuntimeError:
            return None
        scores = queries @ vectors.T
        take = min(k, len(scope))
        out_scores = np.full((len(queries), k), _PAD_SCORE, dtype=np.float32)
        out_ids = np.full((len(queries), k), -1, dtype=np.int64)
        for row, row_scores in enumerate(scores):
            best = np.argpartition(-row_scores, take - 1)[:take]
            # best first; equal scores keep the lower id first
            best = best[np.lexsort((scope[best], -row_scores[best]))]
            out_scores[row, :take] = row_scores[best]
            out_ids[row, :take] = scope[best]
        return out_scores, out_ids

    def _as_matrix(self, x: np.ndarray, name: str) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{name} must have shape [n, {self.dim}], got {list(x.shape)}")
        return np.ascontiguousarray(x)

    def _empty(self) -> Any:
        if self.kind == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, _HNSW_M, faiss.METRIC_INNER_PRODUCT)
        else:
            inner = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(inner)

    def _train_ivf(self) -> None:
        ids, vectors = stored_vectors(self._index)
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT)
        # NOTE: 64 points per list place the centroids well enough for list assignment
        # (bench/ann_bench.py's recall is measured so); more only slows the training, which
        # runs inside the ingest that crosses train_size
        rng = np.random.default_rng(0)
        sample = vectors[rng.permutation(len(vectors))[: _TRAIN_POINTS_PER_LIST * self.nlist]]
        ivf.train(sample)
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # remove_ids and reconstruct by id
        ivf.add_with_ids(vectors, ids)
        ivf.nprobe = self.nprobe
        self._index = ivf
        logger.info("trained IVF index: %d vectors, nlist=%d", len(ids), self.nlist)

    def _remove_by_rebuild(self, ids: np.ndarray) -> int:
        stored_ids, vectors = stored_vectors(self._index)
        keep = ~np.isin(stored_ids, ids)
        self._index = self._empty()
        if keep.any():
            self._index.add_with_ids(vectors[keep], stored_ids[keep])
        return int((~keep).sum())

    def _search_params(self, k: int, allowed: np.ndarray | IdBitmap | None) -> Any:
        if isinstance(allowed, IdBitmap):
            sel = allowed.selector()
        else:
            sel = id_selector(allowed) if allowed is not None else None
        kind = index_kind_of(self._index)
        if kind == "ivf":
            return faiss.SearchParametersIVF(sel=sel, nprobe=self.nprobe)
        if kind == "hnsw":
            return faiss.SearchParametersHNSW(sel=sel, efSearch=max(self.ef_search, k))
        return faiss.SearchParameters(sel=sel) if sel is not None else None

    def _searcher(self) -> Any:
        """The index for unfiltered search: a GPU copy when one is wanted and possible."""
        if not self.use_gpu or index_kind_of(self._index) == "hnsw":
            return self._index
        if self._gpu_index is None:
            try:
                resources = faiss.StandardGpuResources()
                self._gpu_index = faiss.index_cpu_to_gpu(resources, 0, self._index)
                self._gpu_resources = resources
            except Exception as exc:  # NOTE: some index types have no GPU twin; CPU still works
                logger.warning("FAISS GPU copy failed, searching on CPU: %s", exc)
                self.use_gpu = False
                return self._index
        return self._gpu_index

    def _adopt(self, loaded: Any, path: Path) -> None:
        if loaded.d != self.dim:
            raise ValueError(f"index file {path} has dim {loaded.d}, expected {self.dim}")
        found = index_kind_of(loaded)
        compatible = {"flat": {"flat"}, "ivf": {"flat", "ivf"}, "hnsw": {"hnsw"}}[self.kind]
        if found not in compatible:
            raise ValueError(
                f"index file {path} holds a {found} index but kind={self.kind!r} is configured; "
                "rebuild the index"
            )
        if found == "ivf":
            loaded.nprobe = self.nprobe
        with self._lock:
            self._index = loaded
            self._gpu_index = None


def _is_empty(allowed: np.ndarray | IdBitmap) -> bool:
    return allowed.is_empty if isinstance(allowed, IdBitmap) else len(allowed) == 0


def remove_partial_saves(path: Path) -> list[Path]:
    """Delete the temp files that saves killed before their rename left beside `path`; returns
    them. Only for start-up: a save running in another process would lose its temp file."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    partial = sorted(path.parent.glob(f"{glob.escape(_temp_prefix(path))}*"))
    for leftover in partial:
        leftover.unlink(missing_ok=True)
    return partial


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _fsync_dir(directory: Path) -> None:
    # the rename itself is durable only once the directory entry is on disk
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
