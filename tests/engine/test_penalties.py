"""Logit bias and the frequency, presence and repetition penalties against hand-computed values
on a five-token vocabulary."""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.penalties import TokenCounts
from prefixrag.engine.sampler import Sampler
from prefixrag.engine.sampling_params import SamplingParams

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT = [0, 4]
GENERATED = [2, 2, 3]  # token 2 twice, token 3 once


def adjusted(params: SamplingParams, generated: list[int] = GENERATED) -> list[float]:
    """The logits of one more step after ``generated``, as TokenCounts leaves them."""
    counts = TokenCounts()
    counts.start(0, PROMPT)
    x = torch.tensor([LOGITS])
    counts.apply(x, [0], [params])  # the first step makes the sequence's counts
    for token_id in generated:
        counts.record(0, token_id)
    return counts.apply(x, [0], [params])[0].tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # freq * count + pres * (count > 0) off the generated tokens 2 (x2) and 3 (x1)
        (
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
            [2.0, -1.0, 0.5 - 1.0 - 0.25, 3.0 - 0.5 - 0.25, -2.0],
        ),
        # negative penalties reward repeats
        (SamplingParams(presence_penalty=-1.0), [2.0, -1.0, 1.5, 4.0, -2.0]),
        # seen anywhere (prompt 0 and 4, output 2 and 3): positive / 2, negative * 2
        (SamplingParams(repetition_penalty=2.0), [1.0, -1.0, 0.25, 1.5, -4.0]),
        # repetition first, on the model's logits, then the additive penalties
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5),
            [1.0, -1.0, 0.25 - 1.0, 1.5 - 0.5, -4.0],
        ),
        # bias is added whatever was seen
        (SamplingParams(logit_bias={1: 5.0, 4: -100}), [2.0, 4.0, 0.5, 3.0, -102.0]),
    ],
)
def test_adjustments_match_the_hand_computed_logits(params, expected):
    assert adjusted(params) == pytest.approx(expected)


def test_no_output_yet_means_only_the_prompt_counts():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0)
    assert adjusted(params, generated=[]) == pytest.approx([1.0, -1.0, 0.5, 3.0, -4.0])


def test_rows_without_adjustments_are_left_alone():
    x = torch.tensor([LOGITS, LOGITS])
    out = TokenCounts().apply(x, [0, 1], [SamplingParams(), SamplingParams(temperature=0)])
    assert out is x


def test_a_batch_gives_each_row_what_it_gets_alone():
    # one vectorised pass over rows with different penalties equals each row on its own
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, logit_bias={1: 5.0}),
        SamplingParams(logit_bias={3: -1.0}, presence_penalty=2.0),
    ]
    counts = TokenCounts()
    for seq_id in range(4):
        counts.start(seq_id, PROMPT)
    batch = torch.tensor([LOGITS] * 4)
    counts.apply(batch, [0, 1, 2, 3], params)
    for seq_id in range(4):
        for token_id in GENERATED:
            counts.record(seq_id, token_id)
    got = counts.apply(batch, [0, 1, 2, 3], params).tolist()
    assert got == [pytest.approx(adjusted(p)) for p in params]


def test_greedy_with_a_presence_penalty_moves_off_a_repeated_token():
    # token 0 leads by 0.1; once generated it loses 0.5 and token 1 wins, then both are penalised
    x = torch.tensor([[3.0, 2.9, 0.0]])
    s = Sampler()
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    s.start(7, [2], p)
    assert [s.sample(x, [7], [p])[0] for _ in range(3)] == [0, 1, 0]
    plain = SamplingParams(temperature=0)
    assert [s.sample(x, [8], [plain])[0] for _ in range(3)] == [0, 0, 0]


def test_release_forgets_the_counts():
    x = torch.tensor([[3.0, 2.9, 0.0]])
    s = Sampler()
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    s.start(1, [2], p)
    assert s.sample(x, [1], [p]) == [0]
    assert s.sample(x, [1], [p]) == [1]
    s.release(1)
    assert s.sample(x, [1], [p]) == [0]


def test_a_hugely_negative_bias_bans_a_token_and_a_positive_one_forces_it():
    x = torch.tensor([[3.0, 2.9, 0.0]] * 2)
    s = Sampler()
    banned = SamplingParams(temperature=1.0, seed=3, logit_bias={0: -100, 1: -100})
    forced = SamplingParams(temperature=1.0, seed=4, logit_bias={1: 100})
    draws = [s.sample(x, [i, 100 + i], [banned, forced]) for i in range(50)]
    assert {d[0] for d in draws} == {2}
    assert {d[1] for d in draws} == {1}
