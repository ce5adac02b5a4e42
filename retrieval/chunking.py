"""Token-aware, structure-aware chunking of a parsed document."""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefixrag.retrieval.parsing import ParsedDocument

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+")
_WORD = re.compile(r"\S+")


@dataclass(slots=True)
class Chunk:
    """A span of the document: `text == doc.text[start:end]`, with at most chunk_tokens tokens.

    `heading` is the heading path (outermost first) joined with " > "; `page` is the 1-based PDF
    page on which `start` lies.
    """

    ordinal: int
    text: str
    start: int
    end: int
    page: int | None
    heading: str | None
    num_tokens: int


@dataclass(slots=True)
class _Piece:
    start: int
    end: int
    num_tokens: int


class Chunker:
    """Packs paragraphs into chunks of at most `chunk_tokens` tokens, one section at a time.

    A chunk never spans two sections. A paragraph longer than the budget is cut at sentence ends,
    then at spaces, then (for a single huge word) at characters. Consecutive chunks of a section
    share about `overlap_tokens` tokens of trailing text.
    """

    def __init__(
        self, count_tokens: Callable[[str], int], chunk_tokens: int, overlap_tokens: int
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if not 0 <= overlap_tokens < chunk_tokens:
            raise ValueError(
                f"overlap_tokens must be in [0, chunk_tokens={chunk_tokens}), got {overlap_tokens}"
            )
        self.count_tokens = count_tokens
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens
        # pieces are kept small enough that an overlap and one piece always fit in a chunk
        self._piece_limit = chunk_tokens - overlap_tokens

    def split(self, doc: ParsedDocument) -> list[Chunk]:
        """The chunks of `doc` in document order, numbered from 0."""
        chunks: list[Chunk] = []
        for start, end, heading in _section_spans(doc):
            for lo, hi, num_tokens in self._pack(doc.text, self._pieces(doc.text, start, end)):
                chunks.append(
                    Chunk(
                        ordinal=len(chunks),
                        text=doc.text[lo:hi],
                        start=lo,
                        end=hi,
                        page=_page_of(doc.page_starts, lo),
                        heading=heading,
                        num_tokens=num_tokens,
                    )
                )
        return chunks

    # pieces: paragraphs, or parts of a long one, each within the piece limit

    def _pieces(self, text: str, start: int, end: int) -> Iterator[_Piece]:
        for lo, hi in _spans_between(_PARAGRAPH_BREAK, text, start, end):
            yield from self._fit(text, lo, hi, level=0)

    def _fit(self, text: str, lo: int, hi: int, level: int) -> Iterator[_Piece]:
        num_tokens = self.count_tokens(text[lo:hi])
        if num_tokens <= self._piece_limit:
            yield _Piece(lo, hi, num_tokens)
            return
        if level == 0:
            spans = list(_spans_between(_SENTENCE_END, text, lo, hi))
        elif level == 1:
            spans = [(m.start() + lo, m.end() + lo) for m in _WORD.finditer(text[lo:hi])]
        else:
            yield from self._cut_chars(text, lo, hi)
            return
        if len(spans) <= 1:
            yield from self._fit(text, lo, hi, level + 1)
            return
        # neighbours are re-merged while they fit, so a split paragraph isn't word confetti
        yield from self._merge((p for a, b in spans for p in self._fit(text, a, b, level + 1)))

    def _merge(self, pieces: Iterator[_Piece]) -> Iterator[_Piece]:
        current: _Piece | None = None
        for piece in pieces:
            if current is not None and current.num_tokens + piece.num_tokens <= self._piece_limit:
                current = _Piece(current.start, piece.end, current.num_tokens + piece.num_tokens)
                continue
            if current is not None:
                yield current
            current = piece
        if current is not None:
            yield current

    def _cut_chars(self, text: str, lo: int, hi: int) -> Iterator[_Piece]:
        while lo < hi:
            # the longest prefix within the limit, by bisection on its character length
            good, bad = lo + 1, hi + 1
            while bad - good > 1:
                mid = (good + bad) // 2
                if self.count_tokens(text[lo:mid]) <= self._piece_limit:
                    good = mid
                else:
                    bad = mid
            yield _Piece(lo, good, self.count_tokens(text[lo:good]))
            lo = good

    # packing: greedy, with a trailing overlap carried into the next chunk

    def _pack(self, text: str, pieces: Iterator[_Piece]) -> Iterator[tuple[int, int, int]]:
        window: list[_Piece] = []
        total = 0
        for piece in pieces:
            if window and total + piece.num_tokens > self.chunk_tokens:
                yield from self._emit(text, window)
                window = self._overlap(text, window[-1].end, window[0].start)
                total = sum(p.num_tokens for p in window)
            window.append(piece)
            total += piece.num_tokens
        if window:
            yield from self._emit(text, window)

    def _emit(self, text: str, window: list[_Piece]) -> Iterator[tuple[int, int, int]]:
        lo, hi = window[0].start, window[-1].end
        num_tokens = self.count_tokens(text[lo:hi])
        if num_tokens <= self.chunk_tokens or len(window) == 1:
            yield lo, hi, num_tokens
            return
        # NOTE: token counts needn't add up across pieces for every tokenizer; halve when they don't
        half = len(window) // 2
        yield from self._emit(text, window[:half])
        yield from self._emit(text, window[half:])

    def _overlap(self, text: str, end: int, floor: int) -> list[_Piece]:
        """Whole trailing words of text[floor:end] worth at most overlap_tokens tokens."""
        if self.overlap_tokens == 0:
            return []
        start, total = end, 0
        search_from = max(floor, end - 16 * self.overlap_tokens - 64)
        words = [
            (a + search_from, b + search_from)
            for a, b in (m.span() for m in _WORD.finditer(text[search_from:end]))
        ]
        if search_from > floor and words:
            words = words[1:]  # it may begin mid-word
        for a, b in reversed(words):
            cost = self.count_tokens(text[a:b])
            if total + cost > self.overlap_tokens:
                break
            start, total = a, total + cost
        return [_Piece(start, end, total)] if total else []


def _spans_between(
    pattern: re.Pattern[str], text: str, start: int, end: int
) -> Iterator[tuple[int, int]]:
    """Non-blank spans of text[start:end] separated by `pattern`, stripped of outer whitespace."""
    pos = start
    for m in pattern.finditer(text, start, end):
        yield from _stripped(text, pos, m.start())
        pos = m.end()
    yield from _stripped(text, pos, end)


def _stripped(text: str, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    if lo < hi:
        yield lo, hi


def _section_spans(doc: ParsedDocument) -> Iterator[tuple[int, int, str | None]]:
    """(start, end, heading path) for the text before the first section and for each section."""
    sections = sorted(
        (s for s in doc.sections if 0 <= s.start < len(doc.text)), key=lambda s: s.start
    )
    bounds = [0, *(s.start for s in sections), len(doc.text)]
    path: list[tuple[int, str]] = []
    headings: list[str | None] = [None]
    for section in sections:
        while path and path[-1][0] >= section.level:
            path.pop()
        path.append((section.level, section.title))
        headings.append(" > ".join(title for _, title in path if title) or None)
    for i, heading in enumerate(headings):
        if bounds[i] < bounds[i + 1]:
            yield bounds[i], bounds[i + 1], heading


def _page_of(page_starts: list[int] | None, offset: int) -> int | None:
    if not page_starts:
        return None
    return max(1, bisect.bisect_right(page_starts, offset))
