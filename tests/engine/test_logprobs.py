"""Logprobs from the engine against a log-softmax of the model's own logits for the same text."""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model_runner import StepItem
from prefixrag.engine.sampling.params import SamplingParams
from tests.engine.llm_fixtures import make_engine

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    return make_engine(request, block_size=16, enable_prefix_cache=False)


def reference_logprobs(engine: LLMEngine, ids: list[int], num_prompt: int) -> torch.Tensor:
    """log_softmax of one causal forward over prompt + output: row i predicts token i + 1."""
    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))  # the idle engine's pool is free
    logits = runner.run([StepItem(ids, 0, blocks, True)], all_logits=True)
    return torch.log_softmax(logits[num_prompt - 1 : -1], dim=-1)


def test_greedy_logprobs_match_the_models_log_softmax(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    # a penalty changes which tokens are picked, never the reported (raw) logprobs
    penalised = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3, repetition_penalty=1.5
    )
    for p in (params, penalised):
        (result,) = engine.generate([prompt], p)
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        reference = reference_logprobs(engine, prompt + result.token_ids, len(prompt))
        expected = reference.gather(1, torch.tensor(result.token_ids).unsqueeze(1)).squeeze(1)
        got = torch.tensor([lp.logprob for lp in result.logprobs])
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
        assert float(got.sum()) == pytest.approx(float(expected.sum()), abs=1e-2)
        for lp, row in zip(result.logprobs, reference, strict=True):
            assert len(lp.top) == 3
            assert [t for t, _ in lp.top][:1] == [int(row.argmax())]
        if p is params:  # greedy without penalties: the sampled token is the top one
            assert all(lp.token_id == lp.top[0][0] for lp in result.logprobs)


def test_deltas_carry_the_logprobs_of_their_tokens(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    seq_id = engine.add_request(prompt, params)
    streamed, result = [], None
    while result is None:
        for event in engine.step():
            if event.seq_id != seq_id:
                continue
            if hasattr(event.output, "finish_reason"):
                result = event.output
            else:
                streamed.extend(event.output.logprobs or [])
    assert streamed == result.logprobs
    assert all(lp.top == [] for lp in streamed)


def test_no_logprobs_unless_asked(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    assert result.logprobs is None


def test_a_logit_bias_outside_the_vocabulary_is_refused(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    vocab = engine.runner.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(prompt, SamplingParams(logit_bias={vocab: 1.0}))
