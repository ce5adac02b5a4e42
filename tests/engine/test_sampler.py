"""The sampler against direct computations on the same logits."""

from __future__ import annotations

import torch

from prefixrag.engine.sampler import Sampler
from prefixrag.engine.sampling_params import SamplingParams


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    got = Sampler().sample(x, [0, 1, 2, 3], [SamplingParams(temperature=0)] * 4)
    assert got == x.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = logits()
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(top_p=1e-6)] * 2
    assert Sampler().sample(x, [0, 1, 2, 3], params) == x.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    x = logits(rows=1, vocab=1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler().sample(x, [7], [seeded])[0] for _ in range(3)]
    sampler = Sampler()
    batch = torch.cat([logits(rows=2, vocab=1000, seed=5), x])
    other = SamplingParams(temperature=1.0)
    with_others = sampler.sample(batch, [1, 2, 7], [other, other, seeded])[2]
    assert alone == [alone[0]] * 3
    assert with_others == alone[0]


def test_seeded_stream_advances_and_release_resets_it():
    x = logits(rows=1, vocab=1000)
    p = SamplingParams(temperature=1.5, seed=9)
    s = Sampler()
    first = [s.sample(x, [3], [p])[0] for _ in range(5)]
    s.release(3)
    again = [s.sample(x, [3], [p])[0] for _ in range(5)]
    assert first == again
    assert len(set(first)) > 1  # the generator advanced between steps


def test_top_k_and_top_p_only_pick_allowed_tokens():
    x = logits(rows=1, vocab=100, seed=3)
    probs = torch.softmax(x[0], -1)
    order = torch.argsort(probs, descending=True)
    top5 = set(order[:5].tolist())
    mass = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((mass < 0.5).sum()) + 1].tolist())
    s = Sampler()
    k_draws = {s.sample(x, [i], [SamplingParams(top_k=5, seed=i)])[0] for i in range(200)}
    p_draws = {s.sample(x, [i + 1000], [SamplingParams(top_p=0.5, seed=i)])[0] for i in range(200)}
    assert k_draws <= top5 and len(k_draws) > 1
    assert p_draws <= nucleus


def test_temperature_sampling_follows_the_softmax():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = torch.softmax(x[0] / 0.7, -1)
    s = Sampler()
    n = 4000
    counts = torch.zeros(4)
    for i in range(n):
        counts[s.sample(x, [0], [SamplingParams(temperature=0.7, seed=i)])[0]] += 1
        s.release(0)
    # 4 sigma of a binomial at n=4000 is under 0.032 for every probability
    assert torch.allclose(counts / n, expected, atol=0.035)
