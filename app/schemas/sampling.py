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

    def sampling_kwargs(self) -> dict[str, Any]:
        """These fields as SamplingParams keyword arguments."""
        return {
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "logit_bias": dict(self.logit_bias or {}),
        }


def out_of_vocabulary(logit_bias: dict[int, float] | None, vocab_size: int) -> str | None:
    """The message for a logit_bias naming a token past the vocabulary, else None."""
    bad = sorted(t for t in logit_bias or {} if t >= vocab_size)
    if not bad:
        return None
    return (
        f"logit_bias: token ids must be in [0, {vocab_size - 1}] (the model's vocabulary), "
        f"got {', '.join(map(str, bad[:5]))}"
    )
