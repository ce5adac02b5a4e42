"""Text to the terms BM25 counts: lowercase words, identifier parts, stop words, light stemming."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_WORD = re.compile(r"\w+")
_MAX_CACHED_WORDS = 1 << 20

# Function words that carry no topic: they only add postings that every query walks.
STOP_WORDS: frozenset[str] = frozenset(
    str.split(
        """a about above after again all also am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its itself
    just let me more most my myself no nor not of off on once only or other our ours ourselves out
    over own same she should so some such than that the their theirs them themselves then there
    these they this those through to too under until up very was we were what when where which
    while who whom why will with would you your yours yourself yourselves"""
    )
)


@dataclass(slots=True)
class Analyzer:
    """Turns text into BM25 terms; the same analyzer must index and query.

    Words are maximal runs of letters, digits and underscores, lowercased. With
    `split_identifiers`, a word joined by underscores also yields its parts (`add_argument`
    gives `add_argument`, `add`, `argument`), so prose queries meet code names. With `stem`,
    common English inflections are cut (`iterables` and `iterable` meet).
    """

    stop_words: bool = True
    stem: bool = True
    split_identifiers: bool = True
    _cache: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    def terms(self, text: str) -> list[str]:
        """The terms of `text` in order (a word may give several)."""
        out: list[str] = []
        for word in _WORD.findall(text.lower()):
            out.extend(self._terms_of(word))
        return out

    def term_counts(self, text: str) -> dict[str, int]:
        """How often each term occurs in `text` (the same terms as `terms`, counted)."""
        counts: dict[str, int] = {}
        # counting words first (in C) leaves one Python step per distinct word, not per word
        for word, n in Counter(_WORD.findall(text.lower())).items():
            for term in self._terms_of(word):
                counts[term] = counts.get(term, 0) + n
        return counts

    def _terms_of(self, word: str) -> tuple[str, ...]:
        found = self._cache.get(word)
        if found is None:
            found = self._word_terms(word)
            if len(self._cache) < _MAX_CACHED_WORDS:
                self._cache[word] = found
        return found

    def _word_terms(self, word: str) -> tuple[str, ...]:
        parts = [word]
        if self.split_identifiers and "_" in word.strip("_"):
            parts.extend(p for p in word.split("_") if p)
        kept = [p for p in parts if not (self.stop_words and p in STOP_WORDS)]
        if self.stem:
            kept = [light_stem(p) for p in kept]
        return tuple(kept)


def light_stem(word: str) -> str:
    """`word` with one common English suffix removed (plural, -ing, -ed, -ly), if long enough.

    Deliberately weaker than Porter: it never touches words of four letters or fewer, nor words
    with digits or underscores, so identifiers and short keywords stay as written.
    """
    if len(word) <= 4 or not word.isalpha():
        return word
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("sses", "shes", "ches", "xes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    for suffix in ("ing", "ed", "ly"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    return word
