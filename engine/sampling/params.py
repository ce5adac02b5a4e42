"""Per-request generation parameters."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded; raises ValueError on any invalid value.

    ``temperature=0`` is greedy. ``top_k=-1``, ``top_p=1`` and ``min_p=0`` turn those filters
    off. ``stop`` strings end the output (checked by the detokenizer); ``stop_token_ids`` always
    end it, EOS ends it unless ``ignore_eos``. A single stop string is accepted and wrapped in a
    list. ``stop_after`` holds regular expressions (Python's ``re``) searched in the output as it
    grows: the first match ends it, and unlike a stop string the matched text stays in it (the
    Q&A route ends an answer after a sentence saying the sources do not hold the answer).

    The logits are adjusted before any of that, greedy rows included: ``logit_bias`` (token id
    -> value added, OpenAI's) first, then vLLM's ``repetition_penalty`` (a token seen in the
    prompt or the output has a positive logit divided by it, a negative one multiplied by it),
    then OpenAI's ``frequency_penalty`` and ``presence_penalty`` (subtract ``freq * count +
    pres * (count > 0)``, counted over the generated tokens). Last, ``no_repeat_ngram_size=n``
    (Hugging Face's) bans every token that would complete an n-gram the output already holds, so
    no run of n tokens is generated twice (the prompt is not counted: an answer may quote its
    sources). See engine/sampling/penalties.py.

    ``logprobs=k`` reports, for every generated token, its log-probability and the ``k`` most
    likely alternatives (0: the token's own only; None: nothing). They are the model's raw
    log-probabilities (log-softmax of the logits, before bias, penalties and temperature), as
    OpenAI and vLLM report them by default.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_after: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    no_repeat_ngram_size: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # what torch.Generator.manual_seed takes; a larger seed would fail at sampling
            raise ValueError(f"seed must lie in [-2**63, 2**64), got {self.seed}")
        self.stop = _string_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        self.stop_after = _pattern_list(self.stop_after)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise ValueError(
                f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        """True when decoding picks the most likely token every step."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when the output so far (or the prompt) changes the next token's logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.no_repeat_ngram_size > 0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _string_list(stop: object) -> list[str]:
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    return list(stop)


def _pattern_list(patterns: object) -> list[str]:
    if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"stop_after must be a list of regular expressions, got {patterns!r}")
    for pattern in patterns:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"stop_after: {pattern!r} is not a regular expression: {exc}") from exc
        if compiled.search("") is not None:
            raise ValueError(f"stop_after: {pattern!r} matches the empty output")
    return list(patterns)


def _token_id_list(token_ids: object) -> list[int]:
    if not isinstance(token_ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in token_ids):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {token_ids!r}")
    return list(token_ids)


def _logit_bias(bias: object) -> dict[int, float]:
    # The vocabulary's size is not known here: the engine refuses ids past it (add_request).
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token_id, value in bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
    return {int(t): float(v) for t, v in bias.items()}
