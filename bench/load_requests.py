"""One timed request of each kind the load test mixes: upload, search, streamed Q&A question
and OpenAI chat (half streamed). Every request ends as a `Sample`, whatever went wrong."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import httpx

from bench.load_corpus import Corpus

KINDS = ("upload", "search", "query", "chat")
LLM_KINDS = frozenset({"query", "chat"})
LOAD_COLLECTION = "load"
_DETAIL_CHARS = 300


@dataclass(slots=True)
class Sample:
    """The outcome of one request.

    `status` is the HTTP status (None when no response came: then `error` is the exception's
    type). A 2xx stream that broke off or reported an in-band error has `error` "stream: ...".
    `ttft_s` is the time to the first content chunk of a stream.
    """

    kind: str
    started_s: float
    latency_s: float
    status: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    detail: str | None = None
    is_stream: bool = False


@dataclass(slots=True)
class _Outcome:
    status: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    detail: str | None = None
    is_stream: bool = False


@dataclass(slots=True)
class RequestMaker:
    """Sends the requests of each kind on one shared client; remembers accepted upload ids."""

    client: httpx.AsyncClient
    corpus: Corpus
    max_tokens: int = 24
    timeout_s: float = 120.0
    chat_model: str | None = None
    accepted_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    async def run(self, kind: str, rng: random.Random, run_t0: float) -> Sample:
        """Send one request of `kind`; never raises (failures are in the sample)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome = await getattr(self, f"_{kind}")(rng, t0)
        except Exception as exc:  # counted by type; the run goes on
            outcome = _Outcome(error=type(exc).__name__, detail=str(exc)[:_DETAIL_CHARS])
        latency = time.perf_counter() - t0
        return Sample(kind, t0 - run_t0, latency, **asdict(outcome))

    async def _upload(self, rng: random.Random, t0: float) -> _Outcome:
        doc = self.corpus.document(rng)
        params = {"wait": "false"}
        if rng.random() < 0.5:
            body = {"text": doc.text, "title": doc.title, "collection": LOAD_COLLECTION}
            body["metadata"] = {"topic": doc.topic}
            reply = await self.client.post("/v1/documents", params=params, json=body)
        else:
            files = {"file": (f"{doc.title}.md".replace(" ", "_"), doc.text, "text/markdown")}
            form = {"title": doc.title, "collection": LOAD_COLLECTION}
            reply = await self.client.post("/v1/documents", params=params, files=files, data=form)
        if reply.status_code in (201, 202):
            body = reply.json()
            self.accepted_ids.append(int(body.get("document_id", body.get("id", -1))))
        return _checked(reply)

    async def _search(self, rng: random.Random, t0: float) -> _Outcome:
        body = {"query": self.corpus.question(rng), "top_k": 5}
        reply = await self.client.post("/v1/search", json=body)
        outcome = _checked(reply)
        if outcome.error is None and not isinstance(reply.json().get("results"), list):
            outcome.error = "bad body: no results list"
        return outcome

    async def _query(self, rng: random.Random, t0: float) -> _Outcome:
        body = {"question": self.corpus.question(rng), "max_tokens": self.max_tokens}
        body |= {"stream": True, "top_k": 3}
        async with self.client.stream("POST", "/v1/query", json=body) as reply:
            if reply.status_code != 200:
                return _checked(reply, await reply.aread())
            outcome = _Outcome(status=200, is_stream=True, error="stream: ended without done")
            async for event, data in _sse_events(reply.aiter_lines()):
                if event == "delta" and outcome.ttft_s is None and json.loads(data).get("text"):
                    outcome.ttft_s = time.perf_counter() - t0
                elif event == "error":
                    outcome.error, outcome.detail = "stream: error event", data[:_DETAIL_CHARS]
                elif event == "done":
                    outcome.error = None
        return outcome

    async def _chat(self, rng: random.Random, t0: float) -> _Outcome:
        if self.chat_model is None:
            raise ValueError("the chat kind needs a chat model (the server lists none)")
        question = self.corpus.question(rng)
        body = {"model": self.chat_model, "max_tokens": self.max_tokens, "temperature": 0.0}
        body["messages"] = [{"role": "user", "content": question}]
        if rng.random() < 0.5:
            reply = await self.client.post("/v1/chat/completions", json=body)
            outcome = _checked(reply)
            if outcome.error is None:
                content = reply.json()["choices"][0]["message"]["content"]
                outcome.error = None if isinstance(content, str) else "bad body: no content"
            return outcome
        body["stream"] = True
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return _checked(reply, await reply.aread())
            outcome = _Outcome(status=200, is_stream=True, error="stream: ended without [DONE]")
            async for _, data in _sse_events(reply.aiter_lines()):
                if data == "[DONE]":
                    outcome.error = None
                elif outcome.ttft_s is None and _chat_content(data):
                    outcome.ttft_s = time.perf_counter() - t0
        return outcome


def _checked(reply: httpx.Response, raw: bytes | None = None) -> _Outcome:
    if 200 <= reply.status_code < 300:
        return _Outcome(status=reply.status_code)
    text = (raw if raw is not None else reply.content).decode(errors="replace")
    return _Outcome(status=reply.status_code, detail=text[:_DETAIL_CHARS])


def _chat_content(data: str) -> bool:
    choices = json.loads(data).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) per server-sent event; the name is "message" when none is given."""
    event, data = "message", []
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event, "\n".join(data)
