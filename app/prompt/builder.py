"""Prompt assembly, stable parts first: [system | tools | few-shot] [earlier turns] [sources]
[question].

A prompt's token ids are the concatenation of separately tokenized segments: the stable part
(everything up to and including the "Sources:" header of the first user turn), one segment per
source, the question with the template's closing delimiters, and for each earlier turn its
answer and the delimiters that reopen a user turn. Every segment but an answer ends with a
newline or a special token and the next one starts with a non-space character, so the
concatenation equals tokenizing the whole text (tests hold that); an answer is tokenized on its
own, as the model generated it. The stable part is the same ids in every request, ready to be
pinned in the engine's prefix cache, and a follow-up's prompt extends the previous prompt and
answer, so the engine's radix cache serves all of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from prefixrag.app.core.errors import PromptTooLongError
from prefixrag.app.prompt.parts import (
    ANSWER_MARK,
    CONTENT_MARK,
    NO_NEW_SOURCES,
    NO_SOURCES,
    SOURCES_HEADER,
    FewShot,
    PromptConfig,
    Source,
    Turn,
    clean_answer,
    clean_text,
    format_key_lines,
    format_question,
    format_sources,
    load_prompt_config,
    source_body,
    source_header,
)

__all__ = [
    "CHUNK_ORDERS",
    "BuiltPrompt",
    "ChatTokenizer",
    "ChunkOrder",
    "FewShot",
    "PromptBuilder",
    "PromptConfig",
    "Source",
    "Turn",
    "format_sources",
    "load_prompt_config",
]

ChunkOrder = Literal["canonical", "score"]
CHUNK_ORDERS: tuple[ChunkOrder, ...] = ("canonical", "score")


class ChatTokenizer(Protocol):
    """What the builder needs from a tokenizer (engine.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(slots=True)
class BuiltPrompt:
    """A prompt ready for the engine.

    `sources` are the chunks this turn adds, cited as [first_number + i]; `reused` are retrieved
    chunks an earlier kept turn already laid out, with their original numbers. `dropped` are the
    new chunks that did not fit; `dropped_turns` counts the oldest turns left out to fit.
    `body_spans` are (start, length, document id) of each new source's body in `token_ids`: the
    segments whose KV the engine's chunk store may supply at any position.
    """

    token_ids: list[int]
    num_stable_tokens: int
    num_question_tokens: int
    sources: list[Source]
    dropped: list[Source]
    first_number: int = 1
    reused: list[tuple[int, Source]] = field(default_factory=list)
    dropped_turns: int = 0
    body_spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def numbered(self) -> list[tuple[int, Source]]:
        """Every source this turn may cite, as (number, source), by number."""
        new = [(self.first_number + i, s) for i, s in enumerate(self.sources)]
        return sorted(new + self.reused, key=lambda pair: pair[0])


class _SourceTokens:
    """Token ids of source headers and bodies, each encoded once per build: one build lays the
    same sources out several times (fitting, cached-first ordering, spans)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._bodies: dict[int, list[int]] = {}
        self._headers: dict[tuple[int, int], list[int]] = {}

    def body(self, source: Source) -> list[int]:
        ids = self._bodies.get(source.chunk_id)
        if ids is None:
            ids = self._bodies[source.chunk_id] = self._tokenizer.encode(source_body(source))
        return ids

    def header(self, n: int, source: Source) -> list[int]:
        key = (n, source.chunk_id)
        ids = self._headers.get(key)
        if ids is None:
            ids = self._headers[key] = self._tokenizer.encode(source_header(n, source))
        return ids


class PromptBuilder:
    """Builds prompts whose first `len(stable_ids)` tokens never change.

    A conversation's prompt is [stable] [turn 1: sources, question, answer] ... [this turn:
    new sources, question]; each earlier turn's block is exactly the ids that turn's own prompt
    and answer had, so turn n's prompt extends turn n-1's prompt + answer token for token.
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
        self._stable_text, self._closing, self._reopen = self._split_template()
        self.stable_ids = tokenizer.encode(self._stable_text)
        self._reopen_ids = tokenizer.encode(self._reopen)

    @property
    def stable_text(self) -> str:
        return self._stable_text

    def build(
        self,
        question: str,
        ranked: list[Source],
        *,
        max_prompt_tokens: int,
        history: list[Turn] | None = None,
        cached_prefix_len: Callable[[list[int]], int] | None = None,
    ) -> BuiltPrompt:
        """The prompt for `question` over `ranked` (best first) after `history` (oldest first), at
        most `max_prompt_tokens` long.

        With `cached_prefix_len` (how many leading tokens of these ids the engine has cached),
        canonical order picks, among the equally good orders of the documents, the one whose
        prefix is cached longest (RAGCache's idea): an exact hit needs no recompute at all.

        To fit, drops the oldest turns first, then the lowest-ranked new sources one at a time;
        raises PromptTooLongError when even the question alone with no sources is too long.
        """
        question = clean_text(question)
        if not question:
            raise ValueError("the question is empty")
        turns = list(history or [])
        question_ids = self.tokenizer.encode(format_question(question) + self._closing)
        cache = _SourceTokens(self.tokenizer)
        num_dropped_turns, num_kept_sources = 0, len(ranked)
        while True:
            kept_turns = turns[num_dropped_turns:]
            head_ids, cited = self._history_ids(kept_turns, cache)
            new = [s for s in ranked if s.chunk_id not in cited][:num_kept_sources]
            ordered = self._ordered(new)
            if cached_prefix_len is not None and self.order == "canonical":
                ordered = self._cached_first(
                    ordered, head_ids, len(cited) + 1, cache, cached_prefix_len
                )
            source_ids = self._source_ids(ordered, len(cited) + 1, cache, bool(kept_turns))
            total = len(head_ids) + len(source_ids) + len(question_ids)
            if total <= max_prompt_tokens:
                break
            if num_dropped_turns < len(turns):
                num_dropped_turns += 1
            elif new:
                num_kept_sources = len(new) - 1
            else:
                raise PromptTooLongError(
                    f"the question needs {total} prompt tokens but only {max_prompt_tokens} fit "
                    "the context window next to the answer; shorten it or lower max_tokens",
                    "question",
                )
        all_new = [s for s in ranked if s.chunk_id not in cited]
        return BuiltPrompt(
            body_spans=self._body_spans(ordered, len(cited) + 1, cache, len(head_ids)),
            token_ids=[*head_ids, *source_ids, *question_ids],
            num_stable_tokens=len(self.stable_ids),
            num_question_tokens=len(question_ids),
            sources=ordered,
            dropped=all_new[len(new) :],
            first_number=len(cited) + 1,
            reused=[(cited[s.chunk_id], s) for s in ranked if s.chunk_id in cited],
            dropped_turns=num_dropped_turns,
        )

    def with_key_lines(
        self,
        prompt: BuiltPrompt,
        question: str,
        lines: list[tuple[int, str]],
        *,
        max_prompt_tokens: int,
    ) -> BuiltPrompt:
        """`prompt` with `lines` ((chunk id, sentence), best first, of sources it lays out) set
        just before its question, each cited by its source's number; `prompt` itself when there
        are none or they would not fit. A follow-up repeats them from `Turn.key_lines`."""
        numbers = {s.chunk_id: n for n, s in prompt.numbered}
        numbered = [(numbers[c], text) for c, text in lines if c in numbers]
        if not numbered:
            return prompt
        text = format_key_lines(numbered) + format_question(question) + self._closing
        question_ids = self.tokenizer.encode(text)
        head = prompt.token_ids[: len(prompt.token_ids) - prompt.num_question_tokens]
        if len(head) + len(question_ids) > max_prompt_tokens:
            return prompt
        return replace(
            prompt, token_ids=[*head, *question_ids], num_question_tokens=len(question_ids)
        )

    def text(self, question: str, sources: list[Source], history: list[Turn] | None = None) -> str:
        """The same prompt as plain text (for tests and debugging): no turns dropped, no sources
        dropped, `sources` already free of chunks the history laid out."""
        parts = [self._stable_text]
        n = 1
        for i, turn in enumerate(history or []):
            ordered = list(turn.sources)
            numbers = {s.chunk_id: m for m, s in enumerate(ordered, start=n)}
            parts += [format_sources(ordered, n, bool(i)), self._question_text(turn, numbers)]
            parts += [clean_answer(turn.answer), self._reopen]
            n += len(ordered)
        ordered = self._ordered(sources)
        parts += [format_sources(ordered, n, bool(history)), format_question(question)]
        return "".join([*parts, self._closing])

    def _history_ids(
        self, turns: list[Turn], cache: _SourceTokens
    ) -> tuple[list[int], dict[int, int]]:
        """Stable part and earlier turns as ids, and the number each laid-out chunk is cited by."""
        ids = list(self.stable_ids)
        cited: dict[int, int] = {}
        for i, turn in enumerate(turns):
            # as the turn laid them out (cached-first may have moved a document ahead): the
            # numbers its answer cites, and the ids its prompt had
            ordered = list(turn.sources)
            ids += self._source_ids(ordered, len(cited) + 1, cache, bool(i))
            for source in ordered:
                cited[source.chunk_id] = len(cited) + 1
            ids += self.tokenizer.encode(self._question_text(turn, cited))
            ids += self.tokenizer.encode(clean_answer(turn.answer)) + self._reopen_ids
        return ids, cited

    def _question_text(self, turn: Turn, numbers: dict[int, int]) -> str:
        """An earlier turn's key lines (if it had any), question and closing delimiters, as its
        own prompt had them; `numbers` maps its chunks to their source numbers."""
        lines = [(numbers[c], text) for c, text in turn.key_lines if c in numbers]
        return format_key_lines(lines) + format_question(turn.question) + self._closing

    def _ordered(self, sources: list[Source]) -> list[Source]:
        if self.order == "score":
            return list(sources)
        return sorted(sources, key=lambda s: s.canonical_key)

    def _source_ids(
        self, ordered: list[Source], first: int, cache: _SourceTokens, is_follow_up: bool
    ) -> list[int]:
        if not ordered:
            return self.tokenizer.encode(NO_NEW_SOURCES if is_follow_up else NO_SOURCES)
        ids: list[int] = []
        for n, source in enumerate(ordered, start=first):
            ids += cache.header(n, source)
            ids += cache.body(source)
        return ids

    def _cached_first(
        self,
        ordered: list[Source],
        head_ids: list[int],
        first: int,
        cache: _SourceTokens,
        cached_prefix_len: Callable[[list[int]], int],
    ) -> list[Source]:
        """Canonical order with whole documents moved so the longest prefix is cached.

        Any order of the documents is equally good for the answer (each keeps its chunks in
        position order), so greedily put next the document that extends the cached prefix
        furthest; once none does, the rest stay in canonical order.
        """
        groups: list[list[Source]] = []
        for source in ordered:
            if groups and groups[-1][0].document_id == source.document_id:
                groups[-1].append(source)
            else:
                groups.append([source])
        if len(groups) < 2:
            return ordered
        placed: list[Source] = []
        ids = list(head_ids)
        reach = cached_prefix_len(ids)
        while len(groups) > 1:
            best, best_reach = 0, reach
            for i, group in enumerate(groups):
                candidate = ids + self._source_ids(group, first + len(placed), cache, False)
                got = cached_prefix_len(candidate)
                if got > best_reach:
                    best, best_reach = i, got
            if best_reach <= reach:
                break  # nothing extends the cached prefix: canonical from here
            group = groups.pop(best)
            ids += self._source_ids(group, first + len(placed), cache, False)
            placed += group
            reach = best_reach
        return placed + [s for group in groups for s in group]

    def _body_spans(
        self, ordered: list[Source], first: int, cache: _SourceTokens, offset: int
    ) -> list[tuple[int, int, int]]:
        # where each body lies once the sources follow `offset` tokens (see _source_ids)
        spans = []
        for n, source in enumerate(ordered, start=first):
            offset += len(cache.header(n, source))
            length = len(cache.body(source))
            spans.append((offset, length, source.document_id))
            offset += length
        return spans

    def _split_template(self) -> tuple[str, str, str]:
        """(stable text, what closes a user turn and opens the answer, what closes an answer and
        opens the next user turn up to the sources), cut out of the chat template itself."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.config.system_message}]
        for example in self.config.few_shot:
            sources = format_sources(list(example.sources))
            content = SOURCES_HEADER + sources + format_question(example.question)
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant", "content": example.answer.strip()})
        messages += [
            {"role": "user", "content": CONTENT_MARK},
            {"role": "assistant", "content": ANSWER_MARK},
            {"role": "user", "content": CONTENT_MARK},
        ]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if rendered.count(CONTENT_MARK) != 2 or rendered.count(ANSWER_MARK) != 1:
            raise ValueError("the chat template does not embed the messages verbatim")
        before, first_close, rest = re.split(f"[{CONTENT_MARK}{ANSWER_MARK}]", rendered, maxsplit=2)
        reopen, closing = rest.split(CONTENT_MARK)
        if first_close != closing:
            raise ValueError("the chat template closes user turns in two different ways")
        return before + SOURCES_HEADER, closing, reopen + SOURCES_HEADER
