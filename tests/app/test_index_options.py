"""The default index kind, "auto": exact until the configured size, IVF from there on."""

from __future__ import annotations

import numpy as np

from prefixrag.app.core.settings import Settings
from prefixrag.app.startup import index_options
from prefixrag.retrieval.vector_index import VectorIndex


def test_auto_is_exact_until_the_threshold_then_ivf() -> None:
    settings = Settings(index_ann_min_vectors=120, index_nlist=4, index_nprobe=4)
    assert Settings().index_kind == "auto"
    index = VectorIndex(8, **index_options(settings))
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((150, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index.add(np.arange(119), vectors[:119])
    assert not index.is_trained_ivf
    index.add(np.arange(119, 150), vectors[119:])
    assert index.is_trained_ivf and len(index) == 150


def test_other_kinds_pass_through() -> None:
    options = index_options(Settings(index_kind="hnsw"))
    assert options["kind"] == "hnsw" and "train_size" not in options
