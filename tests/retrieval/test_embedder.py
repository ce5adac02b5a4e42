"""The packaged embedder: shapes, normalization, token counts and semantic similarity."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from prefixrag.retrieval.embedder import Embedder


def test_shapes_and_unit_norm(embedder: Embedder) -> None:
    vectors = embedder.encode(["one sentence", "another, longer sentence here", "x"])
    assert vectors.dtype == np.float32 and vectors.shape == (3, embedder.dim)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.encode([]).shape == (0, embedder.dim)
    query = embedder.encode_query("one sentence")
    assert query.shape == (embedder.dim,)
    np.testing.assert_allclose(query, vectors[0], atol=1e-5)


def test_similar_sentences_score_higher(embedder: Embedder) -> None:
    anchor, close, far = embedder.encode(
        [
            "How do I reset my password?",
            "What are the steps to change a forgotten password?",
            "The volcano erupted and covered the village in ash.",
        ]
    )
    assert anchor @ close > anchor @ far + 0.3


def test_count_tokens_matches_tokenizer_untruncated(embedder: Embedder, embedder_path: str) -> None:
    reference = AutoTokenizer.from_pretrained(embedder_path)
    for text in ["", "Hello, world!", "internationalization " * 300]:
        expected = len(reference(text, add_special_tokens=False, verbose=False)["input_ids"])
        assert embedder.count_tokens(text) == expected
    assert embedder.count_tokens("word " * 1000) == 1000  # well past max_seq_length
    assert embedder.max_seq_length == 256 and embedder.dim == 384


def test_bad_input(embedder: Embedder) -> None:
    with pytest.raises(ValueError):
        embedder.encode("a bare string")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        embedder.encode_query("   ")


def test_query_vectors_are_cached_read_only_and_evicted_oldest_first(
    embedder_path: str,
) -> None:
    small = Embedder(embedder_path, cache_queries=2)
    calls: list[list[str]] = []
    encode = small.encode
    small.encode = lambda texts, show_progress=False: calls.append(list(texts)) or encode(texts)  # type: ignore[method-assign]
    first = small.encode_query("where is the lamp?")
    assert small.encode_query("where is the lamp?") is first and len(calls) == 1
    np.testing.assert_array_equal(first, encode(["where is the lamp?"])[0])
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 0.0  # a caller cannot spoil what later calls get
    small.encode_query("b?")
    small.encode_query("c?")  # two kept: the lamp is dropped
    small.encode_query("where is the lamp?")
    assert [c[0] for c in calls] == ["where is the lamp?", "b?", "c?", "where is the lamp?"]
    off = Embedder(embedder_path, cache_queries=0)
    assert off.encode_query("x?") is not off.encode_query("x?")
