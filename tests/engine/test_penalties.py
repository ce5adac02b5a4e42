"""Logit bias and the frequency, presence and repetition penalties against hand-computed values
on a five-token vocabulary."""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sampling.penalties import TokenCounts
from prefixrag.engine.sampling.sampler import Sampler

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


INF = float("-inf")


@pytest.mark.parametrize(
    ("size", "generated", "banned"),
    [
        # after 2 2 3, the bigram heads: (2)->{2, 3}, (3)->{}; the last token is 3: nothing banned
        (2, [2, 2, 3], set()),
        # after 2 3 2, head (2) was followed by 3: 3 is banned
        (2, [2, 3, 2], {3}),
        # unigrams: every generated token is banned
        (1, [2, 2, 3], {2, 3}),
        # trigram (2, 3) -> 1 seen once; the output ends in 2 3 again
        (3, [2, 3, 1, 2, 3], {1}),
        # the prompt never counts: 0 and 4 stay allowed
        (1, [], set()),
    ],
)
def test_no_repeat_ngram_bans_exactly_the_tokens_completing_a_generated_ngram(
    size, generated, banned
):
    out = adjusted(SamplingParams(no_repeat_ngram_size=size), generated)
    assert out == [INF if t in banned else x for t, x in enumerate(LOGITS)]


def test_no_repeat_ngram_matches_a_brute_force_search_over_random_outputs():
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        size = int(torch.randint(1, 5, (1,), generator=rng))
        generated = torch.randint(0, 5, (int(torch.randint(0, 12, (1,), generator=rng)),),
                                  generator=rng).tolist()  # fmt: skip
        tail = generated[len(generated) - size + 1 :] if size > 1 else []
        # reference: t is banned when tail + [t] occurs as a contiguous run of the output
        runs = {tuple(generated[i : i + size]) for i in range(len(generated) - size + 1)}
        ok = len(generated) >= size - 1
        expected = {t for t in range(5) if ok and (*tail, t) in runs}
        out = adjusted(SamplingParams(no_repeat_ngram_size=size), generated)
        assert {t for t, x in enumerate(out) if x == INF} == expected, (size, generated)


def test_greedy_decoding_never_repeats_an_ngram_it_generated():
    # a model that loops 0 1 2 0 1 2 ... greedily; with trigrams banned it has to leave the loop
    cycle = {0: 1, 1: 2, 2: 0, 3: 0, 4: 0}
    s = Sampler()
    p = SamplingParams(temperature=0, no_repeat_ngram_size=3)
    s.start(1, [4], p)
    out: list[int] = []
    last = 2
    for _ in range(12):
        x = torch.full((1, 5), -1.0)
        x[0, cycle[last]] = 5.0
        last = s.sample(x, [1], [p])[0]
        out.append(last)
    trigrams = [tuple(out[i : i + 3]) for i in range(len(out) - 2)]
    assert len(trigrams) == len(set(trigrams))
    assert out[:3] == [0, 1, 2]  # the model's own choice until a repeat would start
