"""SamplingParams and EngineConfig: valid values pass, every invalid one raises ValueError."""

import math

import pytest

from prefixrag.engine.config import EngineConfig
from prefixrag.engine.sampling.params import SamplingParams


def test_sampling_params_defaults_and_normalisation() -> None:
    params = SamplingParams(temperature=0, stop="###", stop_token_ids=(7, 9))
    assert params.is_greedy
    assert params.stop == ["###"]
    assert params.stop_token_ids == [7, 9]
    assert not SamplingParams().is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 1.5},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_k": 0},
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"seed": 1.0},
        {"stop": [""]},
        {"stop": [1]},
        {"stop_after": "x"},
        {"stop_after": ["("]},
        {"stop_after": ["x*"]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": ["a"]},
        {"ignore_eos": 1},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": math.nan},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"5": 1.0}},
        {"logit_bias": [(5, 1.0)]},
        {"logprobs": -1},
        {"logprobs": 1.0},
    ],
)
def test_sampling_params_rejects(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_engine_config_defaults() -> None:
    config = EngineConfig(model="m.gguf")
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (16, 64, 2048)
    assert config.enable_prefix_cache and config.num_kv_blocks is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"block_size": 0},
        {"num_kv_blocks": 0},
        {"kv_cache_gb": -1.0},
        {"gpu_memory_fraction": 0.0},
        {"gpu_memory_fraction": 1.5},
        {"max_num_seqs": 0},
        {"max_num_seqs": 8, "max_num_batched_tokens": 7},
        {"enable_prefix_cache": 0},
        {"attention_backend": "flash"},
        {"dtype": "int8"},
        {"device": "tpu"},
        {"cache_dir": 3},
        {"max_model_len": 0},
    ],
)
def test_engine_config_rejects(kwargs: dict) -> None:
    kwargs.setdefault("model", "m.gguf")
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)
