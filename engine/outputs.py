"""What a generation hands back to its caller: text deltas while it runs, then one final result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the ``top`` most likely tokens
    of that step (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationDelta:
    """New text (possibly empty while a UTF-8 character or stop string is pending) and token ids,
    with one ``logprobs`` entry per token when the request asked for them."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class GenerationResult:
    """The finished request: full text, why it stopped, and its cost in tokens and seconds.

    Of the prompt, ``cached_tokens`` came from an exact prefix hit, ``blended_tokens`` from cached
    chunk bodies at new positions, and ``recomputed_tokens`` were cached bodies computed again.
    ``logprobs`` (when asked for) has one entry per token of the text: the deltas' entries.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    stop_reason: str | int | None = None
    blended_tokens: int = 0
    recomputed_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
