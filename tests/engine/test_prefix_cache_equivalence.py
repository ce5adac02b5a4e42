"""The invariant of the prefix cache: greedy output with the cache on equals output with it off,
whatever was cached before and whatever shares the batch. Every test runs on float32 weights
and on the GGUF file's own blocks (``weight_quant="gguf"``, the block kernel on decode)."""

from __future__ import annotations

import pytest

from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.sampling.params import SamplingParams
from tests.engine.llm_fixtures import greedy_ids, make_engine

BLOCK = 16

SHARED = (
    "You are a careful assistant. Answer from the sources below and cite them.\n"
    "[1] The Rhine rises in the Swiss Alps and flows north to the North Sea, passing Basel, "
    "Strasbourg, Cologne and Rotterdam. It is about 1,230 kilometres long.\n"
    "[2] The Danube rises in the Black Forest and flows east to the Black Sea through ten "
    "countries, more than any other river in the world.\n"
)
QUESTIONS = [
    "Question: Which river reaches the North Sea?\nAnswer:",
    "Question: How many countries does the Danube cross?\nAnswer:",
    "Question: Where does the Rhine rise?\nAnswer:",
]


@pytest.fixture(scope="module", params=["none", "gguf"])
def weight_quant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine_on(request: pytest.FixtureRequest, weight_quant: str) -> LLMEngine:
    return make_engine(request, block_size=BLOCK, weight_quant=weight_quant)


@pytest.fixture(scope="module")
def engine_off(request: pytest.FixtureRequest, weight_quant: str) -> LLMEngine:
    return make_engine(
        request, block_size=BLOCK, enable_prefix_cache=False, weight_quant=weight_quant
    )


@pytest.fixture(scope="module")
def prompts(engine_on: LLMEngine) -> list[list[int]]:
    tok = engine_on.tokenizer
    return [tok.encode(SHARED + q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(engine_off: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, cache off: the output every other configuration must reproduce."""
    outputs = []
    for p in prompts:
        ids, cached = greedy_ids(engine_off, [p])
        assert cached == [0]
        outputs.append(ids[0])
    return outputs


def test_shared_prefix_hits_and_matches_cache_off(engine_on, prompts, reference):
    first, cached_first = greedy_ids(engine_on, [prompts[0]])
    assert cached_first == [0]  # nothing of this prefix was computed before
    second, cached_second = greedy_ids(engine_on, [prompts[1]])
    assert first[0] == reference[0]
    assert second[0] == reference[1]
    shared = len(_common_prefix(prompts[0], prompts[1]))
    # Only whole blocks are shared, and the shared prefix ends mid-block here.
    assert shared % BLOCK != 0
    assert cached_second[0] == shared // BLOCK * BLOCK > 0


def test_fully_cached_prompt_matches_cache_off(engine_on, prompts, reference):
    greedy_ids(engine_on, [prompts[2]])
    again, cached = greedy_ids(engine_on, [prompts[2]])
    assert again[0] == reference[2]
    # Its prompt and the first 64 generated tokens' full blocks are cached; all of the prompt
    # but the block holding its last token is reused.
    assert cached[0] >= (len(prompts[2]) - 1) // BLOCK * BLOCK


def test_mixed_batch_with_hits_and_misses_matches_cache_off(engine_on, engine_off, prompts):
    tok = engine_on.tokenizer
    fresh = tok.encode("A completely different story begins: once upon a time")
    batch = [prompts[1], fresh, prompts[0], prompts[2][: len(prompts[2]) - 5]]
    on_ids, on_cached = greedy_ids(engine_on, batch)
    off_ids, off_cached = greedy_ids(engine_off, batch)
    assert on_ids == off_ids
    assert off_cached == [0, 0, 0, 0]
    assert on_cached[0] > 0 and on_cached[2] > 0 and on_cached[1] == 0


def test_after_evictions_matches_cache_off(request, weight_quant, prompts, reference):
    # Each request needs 8 blocks (about 60 prompt + 64 new tokens) and the pool has 12, so
    # every run must evict blocks cached by the runs before it.
    small = make_engine(
        request, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=2, weight_quant=weight_quant
    )
    outputs = [greedy_ids(small, [p])[0][0] for p in (*prompts, prompts[0], prompts[1])]
    assert small.cache_stats()["evicted_blocks"] > 0
    assert outputs == [*reference, reference[0], reference[1]]


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


PENALISED = SamplingParams(
    max_tokens=48,
    temperature=0.0,
    ignore_eos=True,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.3,
    logit_bias={13: -5.0},
)


def test_penalised_output_is_the_same_cached_and_batched_as_alone(engine_on, engine_off, prompts):
    # Penalties read the sequence's own counts only: neither a cached prefix nor the other rows
    # of the batch may change what a penalised greedy request generates.
    alone = [greedy_ids(engine_off, [p], PENALISED)[0][0] for p in prompts]
    unpenalised = [greedy_ids(engine_off, [p])[0][0][:48] for p in prompts]
    assert alone != unpenalised  # the penalties did change the output
    greedy_ids(engine_on, [prompts[0]], PENALISED)  # cache the shared head
    batched, cached = greedy_ids(engine_on, prompts, PENALISED)
    assert batched == alone
    assert all(n > 0 for n in cached)
