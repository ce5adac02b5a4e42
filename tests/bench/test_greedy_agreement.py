"""bench/greedy_agreement.py's verdicts: where two greedy runs part, and how close that was."""

from __future__ import annotations

import pytest

from bench.greedy_agreement import compare_prompt
from prefixrag.engine.outputs import TokenLogprob


def _steps(ours: list[int], second: int, gap: float) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5, [(t, -0.5), (second, -0.5 - gap)]) for t in ours]


def test_identical_runs_have_no_difference():
    row = compare_prompt([1, 2, 3], [1, 2, 3], _steps([1, 2, 3], 9, 1.0), near_tie=0.1)
    assert row["verdict"] == "identical" and row["first_difference"] is None


@pytest.mark.parametrize(("gap", "verdict"), [(0.05, "near tie"), (0.5, "DISAGREE")])
def test_a_difference_is_judged_by_our_gap_to_their_token(gap, verdict):
    row = compare_prompt([1, 2, 3], [1, 7, 4], _steps([1, 2, 3], 7, gap), near_tie=0.1)
    assert row["first_difference"] == 1
    assert row["gap_nats"] == pytest.approx(gap)
    assert row["theirs_is_our_second"] and row["verdict"] == verdict


def test_their_token_outside_our_top_is_a_disagreement():
    row = compare_prompt([1, 2], [5, 2], _steps([1, 2], 7, 0.01), near_tie=0.1)
    assert row["gap_nats"] is None and row["verdict"] == "DISAGREE"
