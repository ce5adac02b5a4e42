"""A request whose sampling fails is aborted alone: the other sequences of its batch keep their
tokens and finish as if nothing happened, through the engine and through the async front end."""

from __future__ import annotations

import asyncio

import pytest

from prefixrag.engine.async_engine import AsyncEngine
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine, StepFailedError
from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.model_runner import ModelRunner
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sampling.sampler import Sampler
from prefixrag.engine.tokenizer import Tokenizer

VOCAB = 300
PROMPTS = [[(7 * i + j) % 290 + 1 for i in range(13 + 5 * j)] for j in range(3)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
# The sequence the fake failure hits (seeded, so it owns random state to release).
TARGET = SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, TARGET]


def _engine() -> LLMEngine:
    config = ModelConfig("llama", 2, 64, 128, 4, 2, 16, VOCAB, 512)
    runner = ModelRunner.from_config(
        config,
        Tokenizer.word_level(VOCAB),
        EngineConfig(
            model="<random weights>",
            num_kv_blocks=32,
            attention_backend="torch",
            kv_cache_dtype="float32",
        ),
        seed=3,
    )
    return LLMEngine(EngineConfig(model="random", num_kv_blocks=32), runner=runner)


def _fail_sampling(monkeypatch: pytest.MonkeyPatch, on_call: int) -> None:
    """Make the sampler fail for the TARGET request from its ``on_call``-th sampled token on."""
    real = Sampler._sample_row
    calls = {"n": 0}

    def flaky(self, row, seq_id, params):
        if params is TARGET:
            calls["n"] += 1
            if calls["n"] >= on_call:
                raise RuntimeError("bad logit bias")
        return real(self, row, seq_id, params)

    monkeypatch.setattr(Sampler, "_sample_row", flaky)


def _run(engine: LLMEngine) -> tuple[dict[int, GenerationResult], list[StepFailedError]]:
    seq_ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
    results: dict[int, GenerationResult] = {}
    failures: list[StepFailedError] = []
    while engine.has_unfinished():
        try:
            events = engine.step()
        except StepFailedError as exc:
            failures.append(exc)
            events = exc.events
        for event in events:
            if isinstance(event.output, GenerationResult):
                results[event.seq_id] = event.output
    assert sorted(results) == sorted(seq_ids[:2]) or sorted(results) == sorted(seq_ids)
    return results, failures


def test_a_sampling_failure_aborts_only_its_own_sequence(monkeypatch):
    expected, failures = _run(_engine())
    assert not failures and len(expected) == 3
    engine = _engine()
    _fail_sampling(monkeypatch, on_call=3)  # mid decode, the batch all running
    got, failures = _run(engine)
    # one failure, naming only the target; the others finished with the same tokens
    assert [exc.seq_ids for exc in failures] == [[2]]
    assert "seq 2" in str(failures[0]) and "bad logit bias" in str(failures[0])
    assert sorted(got) == [0, 1]
    for seq_id in (0, 1):
        assert got[seq_id].finish_reason == "length"
        assert got[seq_id].token_ids == expected[seq_id].token_ids
    # the aborted sequence holds no blocks and no random state
    assert engine.scheduler.get(2) is None and 2 not in engine.sampler._generators
    stats = engine.cache_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_the_async_front_end_fails_only_the_request_that_failed(monkeypatch):
    expected, _ = _run(_engine())
    engine = AsyncEngine(_engine())
    _fail_sampling(monkeypatch, on_call=3)

    async def collect(prompt, params):
        tokens = []
        async for item in engine.generate(prompt, params):
            if isinstance(item, GenerationDelta):
                tokens.extend(item.token_ids)
            else:
                return tokens, item
        raise AssertionError("no result")

    async def main():
        coros = (collect(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True))
        return await asyncio.gather(*coros, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(outcomes[2], RuntimeError) and "bad logit bias" in str(outcomes[2])
    for seq_id in (0, 1):
        tokens, result = outcomes[seq_id]
        assert result.finish_reason == "length"
        assert tokens == result.token_ids == expected[seq_id].token_ids
