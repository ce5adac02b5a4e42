"""The sampler against direct computations on the same logits."""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.sampling import sampler as sampler_module
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sampling.sampler import FAILED_TOKEN, Sampler, SamplingError, new_generator


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


def test_seeded_generator_is_made_on_the_logits_device(monkeypatch):
    # torch.multinomial takes only a generator on the probabilities' device (a CPU generator
    # with CUDA logits raises), so the sampler must ask for one where the logits are.
    made = []

    def recording(device, seed):
        gen = new_generator(device, seed)
        made.append((device, seed, gen.device))
        return gen

    monkeypatch.setattr(sampler_module, "new_generator", recording)
    x = logits(rows=2, vocab=300)
    s = Sampler()
    params = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0.8)]
    first = [s.sample(x, [4, 5], params)[0] for _ in range(6)]
    # one generator for the seeded row only, made once, then advanced in place
    assert made == [(x.device, 11, x.device)]
    s.release(4)
    again = [s.sample(x, [4, 5], params)[0] for _ in range(6)]
    assert first == again and len(made) == 2


def test_new_generator_is_on_the_device_with_the_usual_stream():
    gen = new_generator(torch.device("cpu"), 123)
    assert gen.device == torch.device("cpu")
    # the same stream as a default CPU generator seeded alike: seeds keep their old outputs
    expected = torch.rand(5, generator=torch.Generator().manual_seed(123))
    assert torch.equal(torch.rand(5, generator=gen), expected)


def test_a_tiny_temperature_is_the_greedy_limit_not_nan():
    x = logits(rows=3, vocab=200)
    got = Sampler().sample(x, [0, 1, 2], [SamplingParams(temperature=1e-300, seed=3)] * 3)
    assert got == torch.argmax(x, dim=-1).tolist()


def test_a_seed_torch_cannot_take_is_refused_up_front():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**70)


class _FailingFor(Sampler):
    """A sampler whose rows of the given seq ids fail (no real parameter makes one fail now)."""

    def __init__(self, failing: set[int]) -> None:
        super().__init__()
        self.failing = failing

    def _sample_row(self, row, seq_id, p):  # type: ignore[no-untyped-def]
        if seq_id in self.failing:
            raise RuntimeError("probability tensor contains nan")
        return super()._sample_row(row, seq_id, p)


def test_a_failing_row_costs_only_its_own_sequence():
    x = logits(rows=4, vocab=200)
    good = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0)]
    bad = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=5)]
    expected = Sampler().sample(x[[0, 2]], [10, 12], good)
    s = _FailingFor({11, 13})
    with pytest.raises(SamplingError, match=r"seq 11.*seq 13") as info:
        s.sample(x, [10, 11, 12, 13], [good[0], bad[0], good[1], bad[1]])
    err = info.value
    assert err.seq_ids == [11, 13]
    assert err.token_ids == [expected[0], FAILED_TOKEN, expected[1], FAILED_TOKEN]
    # the good seeded row advanced exactly once: its next draw is the stream's second
    alone = Sampler()
    alone.sample(x[[0]], [10], [good[0]])
    assert s.sample(x[[0]], [10], [good[0]]) == alone.sample(x[[0]], [10], [good[0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_on_cuda():
    x = logits(rows=3, vocab=1000)
    x[2] = x[0]  # the same distribution, so the same stream draws the same tokens
    x = x.cuda()
    seeded = SamplingParams(temperature=1.0, seed=77)
    other = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        s = Sampler()
        runs.append([s.sample(x, [0, 1, 2], [seeded, other, seeded]) for _ in range(4)])
        gens = [g for per_device in s._generators.values() for g in per_device.values()]
        assert gens and all(g.device == x.device for g in gens)
    # same seed, same stream on this device: in a new sampler, and for another sequence with
    # the same seed (rows 0 and 2 share the seed, not the generator)
    assert [r[0] for r in runs[0]] == [r[0] for r in runs[1]]
    assert [r[0] for r in runs[0]] == [r[2] for r in runs[0]]
    assert len({r[0] for r in runs[0]}) > 1  # the stream advances


def test_min_p_keeps_only_tokens_near_the_most_likely():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p=0.2 keeps those >= 0.1, so never token 3
    x = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    s = Sampler()
    draws = {s.sample(x, [i], [SamplingParams(min_p=0.2, seed=i)])[0] for i in range(300)}
    assert draws == {0, 1, 2}
    everything = {s.sample(x, [i + 1000], [SamplingParams(seed=i)])[0] for i in range(300)}
    assert 3 in everything


def test_logprobs_are_the_raw_log_softmax_whatever_the_adjustments():
    x = logits(rows=3, vocab=60)
    reference = torch.log_softmax(x, dim=-1)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, seed=2, logprobs=0, presence_penalty=1.5),
        SamplingParams(temperature=0),  # asks for none
    ]
    out = Sampler().sample_with_logprobs(x, [0, 1, 2], params)
    first, second, third = out.logprobs
    assert third is None
    assert first is not None and second is not None
    assert first.token_id == out.token_ids[0] == int(x[0].argmax())
    assert first.logprob == pytest.approx(float(reference[0].max()))
    top = torch.topk(reference[0], 3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist())
    assert second.top == []
    assert second.logprob == pytest.approx(float(reference[1, out.token_ids[1]]))


def test_a_failed_row_has_no_logprobs_and_the_others_keep_theirs():
    x = logits(rows=2, vocab=40)
    p = SamplingParams(temperature=0.8, seed=1, logprobs=2)
    with pytest.raises(SamplingError) as info:
        _FailingFor({5}).sample_with_logprobs(x, [4, 5], [p, p])
    assert info.value.logprobs[1] is None
    assert info.value.logprobs[0] is not None and len(info.value.logprobs[0].top) == 2


def test_greedy_token_ids_is_torch_argmax_ties_nan_and_inf_included():
    from prefixrag.engine.sampling.sampler import greedy_token_ids

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=gen)
    logits[1, [3, 700]] = 50.0  # a tie: the first wins
    logits[2, 10] = float("nan")  # NaN counts as the largest
    logits[2, 20] = float("nan")
    logits[3] = float("-inf")  # every token masked out
    logits[4, 999] = float("inf")
    for rows in (logits, logits[2:3], logits[:, ::2]):  # a non-contiguous view too
        assert greedy_token_ids(rows) == torch.argmax(rows, dim=-1).tolist()
