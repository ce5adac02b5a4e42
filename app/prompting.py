"""Prompt assembly, stable parts first: [system | tools | few-shot] [sources] [question].

A prompt's token ids are the concatenation of separately tokenized segments: the stable part
(everything up to and including the "Sources:" header of the last user turn), one segment per
source and the question with the template's closing delimiters. Every segment ends with a
newline and the next one starts with a non-space character, so the concatenation equals
tokenizing the whole text (tests hold that), and the stable part is the same ids in every
request, ready to be pinned in the engine's prefix cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Protocol

from app.services.llm import PromptTooLongError

ChunkOrder = Literal["canonical", "score"]
CHUNK_ORDERS: tuple[ChunkOrder, ...] = ("canonical", "score")

SOURCES_HEADER = "Sources:\n"
NO_SOURCES = "(no sources found)\n"
# A private-use character no template or prompt file contains: marks where the last user
# message's content goes in the rendered chat template.
_CONTENT_MARK = "\ue000"


class ChatTokenizer(Protocol):
    """What the builder needs from a tokenizer (engine.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(slots=True, frozen=True)
class Source:
    """A retrieved chunk the prompt may cite; `score` is its retrieval (or rerank) score."""

    chunk_id: int
    document_id: int
    title: str
    text: str
    start: int = 0
    end: int = 0
    page: int | None = None
    score: float = 0.0

    @property
    def canonical_key(self) -> tuple[int, int, int]:
        """Document, then position inside it: the order that keeps shared chunks a shared prefix."""
        return (self.document_id, self.start, self.chunk_id)


@dataclass(slots=True, frozen=True)
class FewShot:
    """One worked example shown to the model before the real question."""

    sources: tuple[Source, ...]
    question: str
    answer: str

    def __post_init__(self) -> None:
        if not self.question.strip() or not self.answer.strip():
            raise ValueError("a few-shot example needs a question and an answer")


@dataclass(slots=True)
class PromptConfig:
    """The stable first part: system prompt, tool descriptions and few-shot examples."""

    system: str
    tools: str = ""
    few_shot: list[FewShot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.system.strip():
            raise ValueError("the system prompt must not be empty")
        if _CONTENT_MARK in self.system + self.tools:
            raise ValueError("prompt files must not contain U+E000")

    @property
    def system_message(self) -> str:
        """System prompt and tool descriptions as one system turn."""
        parts = [self.system.strip(), self.tools.strip()]
        return "\n\n".join(p for p in parts if p)


def load_prompt_config(system_prompt_file: Path | None = None) -> PromptConfig:
    """The packaged prompt files (app/prompts/), with the system prompt read from
    `system_prompt_file` instead when given."""
    folder = resources.files("app") / "prompts"
    if system_prompt_file is not None:
        system = Path(system_prompt_file).read_text(encoding="utf-8")
    else:
        system = (folder / "system.txt").read_text(encoding="utf-8")
    tools = (folder / "tools.txt").read_text(encoding="utf-8")
    examples = json.loads((folder / "few_shot.json").read_text(encoding="utf-8"))
    return PromptConfig(system, tools, [_few_shot(e) for e in examples])


def _few_shot(raw: dict[str, Any]) -> FewShot:
    sources = tuple(
        Source(chunk_id=-i, document_id=0, title=s["title"], text=s["text"], page=s.get("page"))
        for i, s in enumerate(raw["sources"], start=1)
    )
    return FewShot(sources, raw["question"], raw["answer"])


@dataclass(slots=True)
class BuiltPrompt:
    """A prompt ready for the engine; `sources[i]` is cited as [i + 1]."""

    token_ids: list[int]
    num_stable_tokens: int
    num_question_tokens: int
    sources: list[Source]
    dropped: list[Source]


class PromptBuilder:
    """Builds prompts whose first `len(stable_ids)` tokens never change.

    `order="canonical"` lays sources out by (document, position); "score" keeps retrieval rank
    order (only for benchmarks: it breaks prefix sharing between questions).
    """

    def __init__(
        self, tokenizer: ChatTokenizer, config: PromptConfig, *, order: ChunkOrder = "canonical"
    ) -> None:
        if order not in CHUNK_ORDERS:
            raise ValueError(f"order must be one of {CHUNK_ORDERS}, got {order!r}")
        self.tokenizer = tokenizer
        self.config = config
        self.order = order
        self._stable_text, self._closing = self._split_template()
        self.stable_ids = tokenizer.encode(self._stable_text)

    @property
    def stable_text(self) -> str:
        return self._stable_text

    def build(self, question: str, ranked: list[Source], *, max_prompt_tokens: int) -> BuiltPrompt:
        """The prompt for `question` over `ranked` (best first), at most `max_prompt_tokens` long.

        Drops the lowest-ranked sources, one at a time, until it fits; raises PromptTooLongError
        when even the prompt without sources is too long.
        """
        question = clean_text(question)
        if not question:
            raise ValueError("the question is empty")
        question_ids = self.tokenizer.encode(format_question(question) + self._closing)
        body_ids: dict[int, list[int]] = {}
        kept = list(ranked)
        while True:
            ordered = self._ordered(kept)
            source_ids = self._source_ids(ordered, body_ids)
            total = len(self.stable_ids) + len(source_ids) + len(question_ids)
            if total <= max_prompt_tokens:
                break
            if not kept:
                raise PromptTooLongError(
                    f"the question needs {total} prompt tokens but only {max_prompt_tokens} fit "
                    "the context window next to the answer; shorten it or lower max_tokens",
                    "question",
                )
            kept.pop()
        return BuiltPrompt(
            token_ids=[*self.stable_ids, *source_ids, *question_ids],
            num_stable_tokens=len(self.stable_ids),
            num_question_tokens=len(question_ids),
            sources=ordered,
            dropped=ranked[len(kept) :],
        )

    def text(self, question: str, sources: list[Source]) -> str:
        """The same prompt as plain text (for tests and debugging), sources in builder order."""
        ordered = self._ordered(sources)
        return (
            self._stable_text + format_sources(ordered) + format_question(question) + self._closing
        )

    def _ordered(self, sources: list[Source]) -> list[Source]:
        if self.order == "score":
            return list(sources)
        return sorted(sources, key=lambda s: s.canonical_key)

    def _source_ids(self, ordered: list[Source], body_ids: dict[int, list[int]]) -> list[int]:
        if not ordered:
            return self.tokenizer.encode(NO_SOURCES)
        ids: list[int] = []
        for n, source in enumerate(ordered, start=1):
            ids += self.tokenizer.encode(source_header(n, source))
            if source.chunk_id not in body_ids:
                body_ids[source.chunk_id] = self.tokenizer.encode(source_body(source))
            ids += body_ids[source.chunk_id]
        return ids

    def _split_template(self) -> tuple[str, str]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.config.system_message}]
        for example in self.config.few_shot:
            sources = format_sources(list(example.sources))
            content = SOURCES_HEADER + sources + format_question(example.question)
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant", "content": example.answer.strip()})
        messages.append({"role": "user", "content": _CONTENT_MARK})
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if rendered.count(_CONTENT_MARK) != 1:
            raise ValueError("the chat template does not embed the user message verbatim")
        before, after = rendered.split(_CONTENT_MARK)
        return before + SOURCES_HEADER, after


_SPECIAL_LIKE = re.compile(r"<\|")
_SPACES = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """Text safe to embed: no special-token look-alikes ("<|"), no outer whitespace."""
    return _SPECIAL_LIKE.sub("< |", text.replace(_CONTENT_MARK, "")).strip()


def source_header(n: int, source: Source) -> str:
    """ "[n] Title, page p" on one line."""
    title = _SPACES.sub(" ", clean_text(source.title)) or "untitled"
    page = "" if source.page is None else f", page {source.page}"
    return f"[{n}] {title}{page}\n"


def source_body(source: Source) -> str:
    """The chunk text; a blank chunk becomes "(empty)" so every segment starts non-blank."""
    return (clean_text(source.text) or "(empty)") + "\n"


def format_sources(ordered: list[Source]) -> str:
    """Every source as header and body, numbered in the given order."""
    if not ordered:
        return NO_SOURCES
    return "".join(source_header(n, s) + source_body(s) for n, s in enumerate(ordered, start=1))


def format_question(question: str) -> str:
    return f"Question: {clean_text(question)}"
