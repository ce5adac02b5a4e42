"""The pieces a prompt is made of: sources, earlier turns, the prompt files, and the text
formats of each segment (headers, bodies, the question)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCES_HEADER = "Sources:\n"
NO_SOURCES = "(no sources found)\n"
NO_NEW_SOURCES = "(no new sources; the ones above still apply)\n"
# Where an answer ends, besides EOS and its token budget: where the model starts a question of
# its own in the prompt's format, and right after a first sentence saying that the sources do
# not hold the answer (said once, with nothing made up after it; the evidence spans still show
# what was found).
ANSWER_STOP = ["\nQuestion:"]
NOT_IN_SOURCES = (
    r"\A\s*(?:The|These|This|Those)?\s*(?:provided\s+|given\s+)?"
    r"(?:documents?|sources?|context|text)\s+(?:do|does|did)\s*(?:not|n't)\b[^\n]*?[.!]"
    r"[\"'\u201d)\]]*(?=\s)"
)
# Private-use characters no template or prompt file contains: they mark where a user message's
# content and an earlier answer go in the rendered chat template.
CONTENT_MARK = "\ue000"
ANSWER_MARK = "\ue001"


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
        if CONTENT_MARK in self.system + self.tools or ANSWER_MARK in self.system + self.tools:
            raise ValueError("prompt files must not contain U+E000 or U+E001")

    @property
    def system_message(self) -> str:
        """System prompt and tool descriptions as one system turn."""
        parts = [self.system.strip(), self.tools.strip()]
        return "\n\n".join(p for p in parts if p)


def load_prompt_config(
    system_prompt_file: Path | None = None, few_shot_file: Path | None = None
) -> PromptConfig:
    """The packaged prompt files (app/prompt/defaults/), with the system prompt read from
    `system_prompt_file` and the few-shot examples from `few_shot_file` instead when given (a
    JSON list shaped like defaults/few_shot.json; `[]` means no examples)."""
    folder = Path(__file__).parent / "defaults"
    system = Path(system_prompt_file or folder / "system.txt").read_text(encoding="utf-8")
    tools = (folder / "tools.txt").read_text(encoding="utf-8")
    examples = json.loads(Path(few_shot_file or folder / "few_shot.json").read_text("utf-8"))
    if not isinstance(examples, list):
        raise ValueError("a few-shot file holds a JSON list of examples")
    return PromptConfig(system, tools, [_few_shot(e) for e in examples])


def _few_shot(raw: dict[str, Any]) -> FewShot:
    sources = tuple(
        Source(chunk_id=-i, document_id=0, title=s["title"], text=s["text"], page=s.get("page"))
        for i, s in enumerate(raw["sources"], start=1)
    )
    return FewShot(sources, raw["question"], raw["answer"])


@dataclass(slots=True, frozen=True)
class Turn:
    """An earlier question and answer of the conversation, with the sources its turn laid out
    (in prompt order; `sources` only holds the chunks that turn added, not ones cited before)
    and the key lines set before its question, as (chunk id, sentence)."""

    question: str
    answer: str
    sources: tuple[Source, ...] = ()
    key_lines: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if not clean_text(self.question):
            raise ValueError("an earlier turn's question is empty")


_SPECIAL_LIKE = re.compile(r"<\|")
_SPACES = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """Text safe to embed: no special-token look-alikes ("<|"), no outer whitespace."""
    return _SPECIAL_LIKE.sub("< |", text.replace(CONTENT_MARK, "")).strip()


def source_header(n: int, source: Source) -> str:
    """ "[n] Title, page p" on one line."""
    title = _SPACES.sub(" ", clean_text(source.title)) or "untitled"
    page = "" if source.page is None else f", page {source.page}"
    return f"[{n}] {title}{page}\n"


def source_body(source: Source) -> str:
    """The chunk text; a blank chunk becomes "(empty)" so every segment starts non-blank."""
    return (clean_text(source.text) or "(empty)") + "\n"


def format_sources(ordered: list[Source], first: int = 1, is_follow_up: bool = False) -> str:
    """Every source as header and body, numbered in the given order from `first`."""
    if not ordered:
        return NO_NEW_SOURCES if is_follow_up else NO_SOURCES
    return "".join(source_header(n, s) + source_body(s) for n, s in enumerate(ordered, start=first))


def clean_answer(answer: str) -> str:
    """An earlier answer as the prompt repeats it: kept as generated (leading and trailing spaces
    are tokens the model produced), only special-token look-alikes defused."""
    return _SPECIAL_LIKE.sub("< |", answer.replace(CONTENT_MARK, "").replace(ANSWER_MARK, ""))


def format_question(question: str) -> str:
    return f"Question: {clean_text(question)}"


def format_key_lines(lines: list[tuple[int, str]]) -> str:
    """Evidence sentences set just before the question, each with its source's number: a small
    model copies a line next to the question far more readily than one deep in its sources."""
    return "".join(f"Key line [{n}]: {_SPACES.sub(' ', clean_text(line))}\n" for n, line in lines)
