"""The shapes of OpenAI's responses: full bodies and stream chunks of completions and chats."""

from __future__ import annotations

import time
import uuid
from typing import Any

from prefixrag.app.schemas.openai import make_usage
from prefixrag.engine.outputs import GenerationResult


class Shape:
    """How one endpoint shapes its full response and its stream chunks."""

    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model_id: str) -> None:
        self.model = model_id
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, result: GenerationResult) -> dict[str, Any]:
        body = self.envelope(self.object_full, [self.full_choice(result)])
        body["usage"] = usage_body(result)
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage_body(result)
        return body

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> dict[str, Any] | None:
        return None

    def delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        return {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def delta(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str) -> dict[str, Any]:
        choice = {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        return self.envelope(self.object_chunk, [choice])


class ChatShape(Shape):
    """chat.completion bodies and chat.completion.chunk stream chunks for one response."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def full_choice(self, result: GenerationResult) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text}
        return {
            "index": 0,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def start(self) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self.envelope(self.object_chunk, [choice])

    def delta(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        return self.envelope(self.object_chunk, [choice])

    def finish(self, reason: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "finish_reason": reason}
        return self.envelope(self.object_chunk, [choice])


def usage_body(result: GenerationResult) -> dict[str, Any]:
    usage = make_usage(
        result.prompt_tokens,
        result.completion_tokens,
        result.cached_tokens,
        blended_tokens=result.blended_tokens,
        recomputed_tokens=result.recomputed_tokens,
    )
    return usage.model_dump()
