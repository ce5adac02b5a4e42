"""The sampling controls every generation route takes: penalties, min_p and logit_bias.

Ranges follow OpenAI (penalties in [-2, 2], biases in [-100, 100]) and vLLM's extensions
(`repetition_penalty` > 0, `min_p` in [0, 1]); the engine's SamplingParams says how each is
applied. Token ids in `logit_bias` are checked against the vocabulary where the model is known
(the routes and the Q&A service).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

# Ours, not OpenAI's: each entry is added to the logits at every step.
MAX_LOGIT_BIAS_ENTRIES = 1024

TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class SamplingControls(BaseModel):
    """Fields a request body shares with every other generation route."""

    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # JSON object keys are strings: "50256" arrives as token id 50256
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # Hugging Face's: no run of this many tokens is generated twice (0: off; unset: the route's
    # default, which is off except for the Q&A answers, see Settings.answer_no_repeat_ngram_size)
    no_repeat_ngram_size: int | None = Field(None, ge=0, le=64)

    def sampling_kwargs(self, *, no_repeat_ngram_size: int = 0) -> dict[str, Any]:
        """These fields as SamplingParams keyword arguments; `no_repeat_ngram_size` is the
        route's default for a request that leaves it unset."""
        return {
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "logit_bias": dict(self.logit_bias or {}),
            "no_repeat_ngram_size": (
                no_repeat_ngram_size
                if self.no_repeat_ngram_size is None
                else self.no_repeat_ngram_size
            ),
        }

    def sampling_fields(self) -> dict[str, Any]:
        """These fields as they were sent (unset ones as None), to hand to another body."""
        return self.model_dump(include=set(SamplingControls.model_fields))


def out_of_vocabulary(logit_bias: dict[int, float] | None, vocab_size: int) -> str | None:
    """The message for a logit_bias naming a token past the vocabulary, else None."""
    bad = sorted(t for t in logit_bias or {} if t >= vocab_size)
    if not bad:
        return None
    return (
        f"logit_bias: token ids must be in [0, {vocab_size - 1}] (the model's vocabulary), "
        f"got {', '.join(map(str, bad[:5]))}"
    )
