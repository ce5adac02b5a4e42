"""answer_eval's peer column: llama.cpp fed the very prompt ids the app built, and who is to blame
where the answers part.

The app's last generation is recorded in process (`LastGeneration`: its prompt ids, sampling
params and result). The peer then continues the same ids greedily on the same GGUF file, with
the same token budget, stopped by the same EOS ids, and its text is cut by the same stop strings
and stop-after patterns as the engine cuts ours. Where the two answers differ, the first token
where they part says why (`blame`):
- "near tie": llama.cpp's own log-probabilities there put our token within NEAR_TIE_NATS of its
  choice: two summation orders, either may win (bench/greedy_agreement.py's rule);
- "reuse": a real gap, and our prompt's KV was partly blended from cached chunk bodies;
- "engine": a real gap on a prompt computed in full.
Where both answers are the same and wrong, the prompt (or the model) is to blame, not the engine.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams

NEAR_TIE_NATS = 0.1
FIRST_TOKENS = 16  # the measure: the greedy first 16 tokens equal on both sides


@dataclass
class LastGeneration:
    """Wraps an LLMService's `generate` to keep what its last call was fed and gave."""

    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    result: GenerationResult | None = None

    def install(self, llm: Any) -> None:
        inner = llm.generate

        def generate(
            prompt_ids: list[int], params: SamplingParams, **kwargs: Any
        ) -> AsyncIterator[GenerationDelta | GenerationResult]:
            self.prompt_ids, self.params, self.result = list(prompt_ids), params, None
            return self._watch(inner(prompt_ids, params, **kwargs))

        llm.generate = generate

    async def _watch(
        self, stream: AsyncIterator[GenerationDelta | GenerationResult]
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        async for item in stream:
            if isinstance(item, GenerationResult):
                self.result = item
            yield item


def cut_at_stops(text: str, params: SamplingParams) -> str:
    """`text` ended where the engine would end it: before the first stop string, or after the
    first match of a stop-after pattern, whichever comes first."""
    end = len(text)
    for stop in params.stop:
        at = text.find(stop)
        if at != -1:
            end = min(end, at)
    for pattern in params.stop_after:
        match = re.search(pattern, text)
        if match is not None:
            end = min(end, match.end())
    return text[:end]


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where the two id lists differ (the shorter one's length when it is a
    prefix of the longer), None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def peer_answer(peer: Any, tokenizer: Any, last: LastGeneration) -> dict[str, Any]:
    """The peer's answer to the prompt `last` recorded, and the blame where it differs."""
    if last.params is None or last.result is None:
        raise RuntimeError("the app generated nothing for this question")
    params, ours = last.params, last.result
    stop_ids = sorted({*tokenizer.eos_token_ids, *params.stop_token_ids})
    theirs = peer.generate(last.prompt_ids, params.max_tokens, stop_ids)
    text = cut_at_stops(tokenizer.decode(theirs, skip_special_tokens=True), params)
    same = " ".join(text.split()) == " ".join(ours.text.split())
    part = first_difference(ours.token_ids, theirs)
    row: dict[str, Any] = {
        "answer": text.strip(),
        "same_answer": same,
        # the same answer cut short by a stop counts: the peer's ids run on past the stop
        "first_tokens_equal": same or part is None or part >= FIRST_TOKENS,
        "prompt_tokens": len(last.prompt_ids),
        "our_blended_tokens": ours.blended_tokens,
        "first_difference": None,
        "gap_nats": None,
        "blame": None,
    }
    if same:
        return row
    row["first_difference"] = part
    if part is None or part >= min(len(ours.token_ids), len(theirs)):
        # one stopped where the other went on: the stop token was the choice that parted them
        row["blame"] = "reuse" if ours.blended_tokens else "engine"
        return row
    theirs_lp, ours_lp = peer.next_logprobs(
        last.prompt_ids + ours.token_ids[:part], [theirs[part], ours.token_ids[part]]
    )
    row["gap_nats"] = theirs_lp - ours_lp
    if row["gap_nats"] < NEAR_TIE_NATS:
        row["blame"] = "near tie"
    else:
        row["blame"] = "reuse" if ours.blended_tokens else "engine"
    return row


def peer_summary(rows: list[dict[str, Any]]) -> dict[str, float | int]:
    """The peer column of a configuration: its accuracy and refusals beside ours, and the blame
    counts where the two answers differ."""
    pairs = [r for r in rows if "peer" in r]
    if not pairs:
        return {}
    recalled = [r for r in pairs if r["recall"]]
    blames = [r["peer"]["blame"] for r in pairs]
    return {
        "peer_answer_accuracy": sum(r["peer"]["answer_ok"] for r in pairs) / len(pairs),
        "peer_refusals_when_recalled": (
            sum(r["peer"]["refusal"] for r in recalled) / len(recalled) if recalled else 0.0
        ),
        "same_answer": sum(r["peer"]["same_answer"] for r in pairs) / len(pairs),
        "first_tokens_equal": sum(r["peer"]["first_tokens_equal"] for r in pairs) / len(pairs),
        "both_wrong_same_answer": sum(
            r["peer"]["same_answer"] and not r["answer_ok"] for r in pairs
        ),
        "differ_near_tie": blames.count("near tie"),
        "differ_engine": blames.count("engine"),
        "differ_reuse": blames.count("reuse"),
        "only_ours_right": sum(r["answer_ok"] and not r["peer"]["answer_ok"] for r in pairs),
        "only_peer_right": sum(r["peer"]["answer_ok"] and not r["answer_ok"] for r in pairs),
    }
