"""Builders shared by the engine-level tests: real engines on the packaged SmolLM2."""

from __future__ import annotations

import pytest

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.sampling.params import SamplingParams

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def model_cache_dir(request: pytest.FixtureRequest) -> str:
    # The same folder the model tests use, so the GGUF is converted once per checkout.
    return str(request.config.cache.mkdir("prefixrag-engine-models"))


def make_engine(request: pytest.FixtureRequest, **overrides: object) -> LLMEngine:
    fields: dict[str, object] = {
        "model": packaged_llm_path(),
        "cache_dir": model_cache_dir(request),
        "num_kv_blocks": 256,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 16,
    }
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))  # type: ignore[arg-type]


def greedy_ids(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY_64):
    """Token ids and cached-token counts of a batched greedy run."""
    results = engine.generate(prompts, params)
    return [r.token_ids for r in results], [r.cached_tokens for r in results]
