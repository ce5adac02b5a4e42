"""answer_eval's peer column: the prompt the app fed its engine, the peer's answer cut as the
engine cuts ours, and the blame where the two part."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from bench.answer_peer import (
    LastGeneration,
    cut_at_stops,
    first_difference,
    peer_answer,
    peer_summary,
)
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.outputs import GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from tests.engine.llm_fixtures import make_engine


class EnginePeer:
    """Our own engine in the peer's place: greedy ids up to a stop id, no stop strings."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_ids)
        return self.engine.generate([prompt], params)[0].token_ids

    def next_logprobs(self, prompt: list[int], candidates: list[int]) -> list[float]:
        raise AssertionError("the same engine on the same prompt never parts")


def test_the_peer_sees_the_prompt_the_app_fed_and_cuts_as_the_engine_does(
    request: pytest.FixtureRequest,
) -> None:
    engine = make_engine(request)
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("The seven colours of the rainbow are red, orange,")
    # a stop string and a stop-after pattern the greedy text runs into
    free = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0].text
    words = free.split()
    assert len(words) >= 4, free
    params = SamplingParams(
        max_tokens=48, temperature=0.0, stop=[words[3]], stop_after=[re.escape(words[1])]
    )

    async def app_generate(prompt_ids: list[int], params: SamplingParams, **_: object):
        for result in engine.generate([prompt_ids], params):
            yield result

    llm = SimpleNamespace(generate=app_generate)
    last = LastGeneration()
    last.install(llm)

    async def consume() -> None:
        async for _ in llm.generate(prompt, params):
            pass

    asyncio.run(consume())
    assert last.prompt_ids == prompt and last.params is params and last.result is not None
    row = peer_answer(EnginePeer(engine), tokenizer, last)
    assert row["same_answer"], (row["answer"], last.result.text)
    assert row["blame"] is None and row["prompt_tokens"] == len(prompt)
    assert row["first_tokens_equal"]
    assert len(row["answer"]) < len(free.strip())  # the cut happened


def test_stops_end_the_text_where_the_first_one_falls() -> None:
    params = SamplingParams(max_tokens=8, stop=["\nQuestion:"], stop_after=[r"do not cover it\."])
    assert cut_at_stops("It is 42.\nQuestion: next", params) == "It is 42."
    assert cut_at_stops("They do not cover it. But", params) == "They do not cover it."
    assert cut_at_stops("no stop here", params) == "no stop here"


def test_the_first_difference_counts_a_prefix_as_parting_where_it_ends() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _result(ids: list[int], text: str, blended: int = 0) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        text=text,
        token_ids=ids,
        finish_reason="stop",
        prompt_tokens=3,
        cached_tokens=0,
        completion_tokens=len(ids),
        ttft_s=0.0,
        tpot_s=0.0,
        blended_tokens=blended,
    )


class ScriptedPeer:
    """A peer whose answer and log-probabilities are given, to pin the blame rules."""

    def __init__(self, ids: list[int], logprobs: tuple[float, float]) -> None:
        self.ids, self.logprobs = ids, logprobs
        self.asked: list[tuple[list[int], list[int]]] = []

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        return self.ids

    def next_logprobs(self, prompt: list[int], candidates: list[int]) -> list[float]:
        self.asked.append((prompt, candidates))
        return list(self.logprobs)


@pytest.mark.parametrize(
    ("gap", "blended", "blame"),
    [(0.05, 0, "near tie"), (0.05, 40, "near tie"), (1.5, 0, "engine"), (1.5, 40, "reuse")],
)
def test_where_answers_part_the_peers_gap_names_the_cause(
    gap: float, blended: int, blame: str
) -> None:
    tokenizer = SimpleNamespace(
        eos_token_ids={0}, decode=lambda ids, skip_special_tokens: " ".join(map(str, ids))
    )
    last = LastGeneration(
        [7, 8, 9], SamplingParams(max_tokens=4), _result([1, 2, 3], "1 2 3", blended)
    )
    peer = ScriptedPeer([1, 5, 6], (-0.2, -0.2 - gap))
    row = peer_answer(peer, tokenizer, last)
    assert row["blame"] == blame and row["first_difference"] == 1
    assert not row["first_tokens_equal"]
    assert row["gap_nats"] == pytest.approx(gap)
    # asked at the parting: the prompt and our tokens before it, their token then ours
    assert peer.asked == [([7, 8, 9, 1], [5, 2])]


def test_the_summary_counts_each_cause_and_who_was_right() -> None:
    peer = {"answer_ok": False, "refusal": True, "same_answer": False, "blame": "engine"}
    peer["first_tokens_equal"] = False
    rows = [
        {"answer_ok": True, "recall": True, "peer": peer},
        {"answer_ok": False, "recall": True, "peer": {**peer, "same_answer": True, "blame": None}},
        {
            "answer_ok": False,
            "recall": False,
            "peer": {**peer, "answer_ok": True, "blame": "near tie"},
        },
    ]
    summary = peer_summary(rows)
    assert summary["peer_answer_accuracy"] == pytest.approx(1 / 3)
    assert summary["peer_refusals_when_recalled"] == 1.0
    assert summary["both_wrong_same_answer"] == 1
    assert summary["first_tokens_equal"] == 0.0
    assert (summary["differ_engine"], summary["differ_near_tie"], summary["differ_reuse"]) == (
        1,
        1,
        0,
    )
    assert (summary["only_ours_right"], summary["only_peer_right"]) == (1, 1)
    assert peer_summary([{"answer_ok": True, "recall": True}]) == {}
