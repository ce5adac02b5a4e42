"""Sentence spans of a chunk's text, as character offsets, for evidence highlighting.

A line break ends a sentence: in the documents we serve it ends a list item, a heading, a table
row or a code line even when no full stop does. Inside a line, a sentence ends at . ! or ?
followed by space and something that can open a sentence, unless the word before the stop is a
common abbreviation. A fragment that doesn't stand alone is joined to the next span, up to a
length a person still reads as one highlight: a short one (a bullet's label, one code token),
and a line that ends with no stop at all (an API signature or a heading, whose next sentence
says what it is). A line of code (a doctest prompt, a traceback, an indented line) joins only
the code after it: code lines end with no stop, and joining them went on into the prose after
the block, so the sentence that answers ("If a finally clause is present, ...") was scored and
highlighted glued to the tail of a traceback.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"[^\n]+")
# the break after a sentence: its stop, closing quotes or brackets, then the space before the next
_BREAK = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9`*_>])")
_LAST_WORD = re.compile(r"(\w+)\.[\"')\]]*$")
_ABBREVIATIONS = frozenset(
    {"e.g", "i.e", "etc", "vs", "cf", "al", "approx", "fig", "no", "mr", "mrs", "dr", "st", "sec"}
)
_WORD = re.compile(r"\w+")
# a line of code: a doctest prompt (">>> ", "... "), a traceback's first line, or an indented line
_CODE_LINE = re.compile(r"[ \t]*(?:>>>|\.\.\.)|Traceback \(|[ \t]{2,}\S")
_STOPS = ".!?:;"
# a numbered section heading on a line of its own ("5.1.1. Using Lists as Stacks"): two levels at
# least, so a numbered step of a list ("1. Open the file") is not one
_NUMBERED_HEADING = re.compile(r"\d+(?:\.\d+)+\.?[ \t]+[A-Z][^\n]*[^\n.!?:;]\n\n")

MIN_CHARS = 40  # a span shorter than this is joined to the next one...
MAX_JOINED_CHARS = 240  # ...while the two together stay this short


def sentence_spans(
    text: str, *, code_aware: bool = True, skip_headings: bool = True
) -> list[tuple[int, int]]:
    """Spans (start, end) of `text`'s sentences in order, without surrounding whitespace; each
    holds at least one word. `text[start:end]` is the sentence. With `code_aware` off, a span
    ending in a line of code may join the prose after it (the splitting before code lines were
    told apart, kept for the benchmark's comparison). With `skip_headings`, a numbered section
    heading is in no span and no span joins across it: it names the topic, and glued to the
    section's first sentence it made that sentence (which restates the topic) outscore the one
    that answers."""
    spans: list[tuple[int, int]] = []
    pieces: list[tuple[int, int]] = []  # since the last skipped heading: no join crosses one
    for line in _LINE.finditer(text):
        if skip_headings and _NUMBERED_HEADING.match(text, line.start()):
            spans += _join_short(text, _worded(text, pieces), code_aware)
            pieces = []
            continue
        start = line.start()
        for cut in _BREAK.finditer(text, line.start(), line.end()):
            if not _is_abbreviation(text[start : cut.start()]):
                pieces.append((start, cut.start()))
                start = cut.end()
        pieces.append((start, line.end()))
    return spans + _join_short(text, _worded(text, pieces), code_aware)


def _worded(text: str, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    stripped = [_strip(text, lo, hi) for lo, hi in pieces]
    return [s for s in stripped if _WORD.search(text, s[0], s[1])]


def _is_abbreviation(sentence: str) -> bool:
    found = _LAST_WORD.search(sentence)
    if found is None:
        return False
    word = found.group(1).lower()
    # "e.g." ends in "g." after "e."; single letters are initials ("J. Smith")
    tail = sentence[: found.end()].lower().rstrip("\"')]")
    return word in _ABBREVIATIONS or len(word) == 1 or tail.endswith(("e.g.", "i.e."))


def _strip(text: str, lo: int, hi: int) -> tuple[int, int]:
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    return lo, hi


def is_code_line(text: str, pos: int) -> bool:
    """Whether the line holding `text[pos]` is a line of code."""
    return _CODE_LINE.match(text, text.rfind("\n", 0, pos) + 1) is not None


def _join_short(text: str, spans: list[tuple[int, int]], code_aware: bool) -> list[tuple[int, int]]:
    joined: list[tuple[int, int]] = []
    for lo, hi in spans:
        if joined:
            prev_lo, prev_hi = joined[-1]
            dangling = prev_hi - prev_lo < MIN_CHARS or text[prev_hi - 1] not in _STOPS
            prose_after_code = (
                code_aware and is_code_line(text, prev_hi - 1) and not is_code_line(text, lo)
            )
            if dangling and not prose_after_code and hi - prev_lo <= MAX_JOINED_CHARS:
                joined[-1] = (prev_lo, hi)
                continue
        joined.append((lo, hi))
    return joined
