"""Lexical (BM25) scoring and reciprocal-rank fusion with the dense order."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

_TOKEN = re.compile(r"\w+")
RRF_K = 60  # the usual RRF constant: damps the head so neither list dominates


def bm25_tokens(text: str) -> list[str]:
    """Lowercased word tokens, the unit BM25 counts."""
    return _TOKEN.findall(text.lower())


def bm25_scores(query: str, texts: Sequence[str]) -> np.ndarray:
    """BM25 (Okapi) score of each text for `query`, with statistics over `texts` alone."""
    from rank_bm25 import BM25Okapi

    if len(texts) == 0:
        return np.zeros(0, dtype=np.float32)
    corpus = [bm25_tokens(t) or [""] for t in texts]
    return np.asarray(BM25Okapi(corpus).get_scores(bm25_tokens(query)), dtype=np.float32)


def rrf(*rankings: np.ndarray, k: int = RRF_K) -> np.ndarray:
    """Reciprocal-rank fusion: sum over rankings of 1 / (k + rank), ranks 0-based per item."""
    if not rankings:
        raise ValueError("rrf needs at least one ranking")
    return np.sum([1.0 / (k + 1 + np.asarray(r, dtype=np.float64)) for r in rankings], axis=0)


def ranks_of(scores: np.ndarray) -> np.ndarray:
    """The 0-based rank of each item when sorted by descending score (ties keep input order)."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(len(order))
    return ranks


def bm25_fuse(query: str, texts_in_dense_order: Sequence[str]) -> np.ndarray:
    """RRF of each text's dense rank (its position) and its BM25 rank among these texts."""
    dense_ranks = np.arange(len(texts_in_dense_order))
    return rrf(dense_ranks, ranks_of(bm25_scores(query, texts_in_dense_order)))
