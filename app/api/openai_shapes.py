"""The shapes of OpenAI's responses: full bodies and stream chunks of completions and chats."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from prefixrag.app.schemas.openai import make_usage
from prefixrag.engine.outputs import GenerationResult, TokenLogprob

# The text of one token id (the tokenizer's), for the logprobs' `token` fields.
TokenText = Callable[[int], str]


class Shape:
    """How one endpoint shapes its full response and its stream chunks."""

    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model_id: str, token_text: TokenText = str) -> None:
        self.model = model_id
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.token_text = token_text

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, result: GenerationResult) -> dict[str, Any]:
        return self.full_n([result])

    def full_n(self, results: list[GenerationResult]) -> dict[str, Any]:
        """One body with a choice per result, in order."""
        choices = [self.full_choice(r, i) for i, r in enumerate(results)]
        body = self.envelope(self.object_full, choices)
        body["usage"] = usage_body(*results)
        return body

    def usage_chunk(self, result: GenerationResult, *others: GenerationResult) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage_body(result, *others)
        return body

    def full_choice(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def start(self, index: int = 0) -> dict[str, Any] | None:
        return None

    def delta(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, reason: str, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model_id: str, token_text: TokenText = str) -> None:
        super().__init__(model_id, token_text)
        self._text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far

    def full_choice(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        return {
            "index": index,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": self._logprobs(result.logprobs, 0),
        }

    def delta(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(text)
        choice = {
            "index": index,
            "text": text,
            "finish_reason": None,
            "logprobs": self._logprobs(logprobs, offset),
        }
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "text": "", "finish_reason": reason, "logprobs": None}
        return self.envelope(self.object_chunk, [choice])

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        # the legacy completions shape: parallel lists, alternatives as {token text: logprob}
        if logprobs is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


class ChatShape(Shape):
    """chat.completion bodies and chat.completion.chunk stream chunks for one response."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def full_choice(self, result: GenerationResult, index: int = 0) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text}
        return {
            "index": index,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": self._logprobs(result.logprobs),
        }

    def start(self, index: int = 0) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "finish_reason": None}
        return self.envelope(self.object_chunk, [choice])

    def delta(
        self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
        if logprobs is not None:
            choice["logprobs"] = self._logprobs(logprobs)
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": {}, "finish_reason": reason}
        return self.envelope(self.object_chunk, [choice])

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def usage_body(first: GenerationResult, *others: GenerationResult) -> dict[str, Any]:
    """Usage of one response. With several choices the prompt counts once, as the first choice
    computed it (the others reuse its cached prefix); completion tokens add up."""
    usage = make_usage(
        first.prompt_tokens,
        first.completion_tokens + sum(r.completion_tokens for r in others),
        first.cached_tokens,
        blended_tokens=first.blended_tokens,
        recomputed_tokens=first.recomputed_tokens,
    )
    return usage.model_dump()
