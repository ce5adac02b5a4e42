"""Reciprocal-rank fusion of several rankings of chunk ids (dense and lexical)."""

from __future__ import annotations

from collections.abc import Sequence

RRF_K = 60  # the usual RRF constant: damps the head so neither list dominates


def rrf_scores(
    rankings: Sequence[Sequence[int]], weights: Sequence[float], k: float = RRF_K
) -> dict[int, float]:
    """Each id's fused score: sum over rankings holding it of weight / (k + rank), rank 1-based.

    An id absent from a ranking gets nothing from it. Rankings must not repeat an id.
    """
    if not rankings:
        raise ValueError("rrf needs at least one ranking")
    if len(weights) != len(rankings):
        raise ValueError(f"{len(weights)} weights for {len(rankings)} rankings")
    if k < 0 or any(w < 0 for w in weights):
        raise ValueError(f"k and weights must be >= 0, got k={k}, weights={list(weights)}")
    scores: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        if len(set(ranking)) != len(ranking):
            raise ValueError("a ranking repeats an id")
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + weight / (k + rank)
    return scores


def rrf_fuse(
    rankings: Sequence[Sequence[int]], weights: Sequence[float], k: float = RRF_K
) -> list[int]:
    """The union of the rankings' ids by descending fused score (see rrf_scores).

    Ties keep the order of first appearance, scanning the rankings in the order given.
    """
    scores = rrf_scores(rankings, weights, k)
    position = {item: i for i, item in enumerate(scores)}  # dicts keep first-insertion order
    return sorted(scores, key=lambda item: (-scores[item], position[item]))
