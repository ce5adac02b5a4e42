"""Incremental detokenization: text deltas that never split a UTF-8 character or a stop string."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Byte-level BPE decodes an incomplete UTF-8 sequence to U+FFFD; we hold such text back until the
# next token completes the character.
_REPLACEMENT = "\ufffd"
# How many tokens before the first unread one are re-decoded for context. A few tokens suffice for
# any tokenizer that merges whitespace or bytes across a token boundary.
_CONTEXT_TOKENS = 6


@dataclass(slots=True)
class DetokenizerStep:
    """What one new token adds: the safe text delta and, if a stop string matched, which one."""

    delta: str
    stopped_on: str | None = None


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    ``decode`` maps token ids to text. Output is held back while it ends in an incomplete UTF-8
    character, or while its tail could still grow into one of ``stop`` strings. When a stop string
    appears, the text before it is emitted and the string itself never is. When one of the
    ``stop_after`` patterns first matches the text, the text up to the end of the match is
    emitted and the rest never is.
    """

    decode: Callable[[Sequence[int]], str]
    stop: Sequence[str] = ()
    stop_after: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all decoded text so far (may include a held-back tail)
    emitted: int = 0  # chars of `text` already handed out
    _prefix_offset: int = 0
    _read_offset: int = 0
    _stop_after: list[re.Pattern[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop_after = [re.compile(p) for p in self.stop_after]

    def add(self, token_id: int) -> DetokenizerStep:
        """Feed one generated token and get the delta that is now safe to show."""
        self.token_ids.append(token_id)
        prefix_text = self.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self.decode(self.token_ids[self._prefix_offset :])
        if full_text.endswith(_REPLACEMENT) or len(full_text) < len(prefix_text):
            return DetokenizerStep("")
        self.text += full_text[len(prefix_text) :]
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return self._emit()

    def flush(self) -> str:
        """At the end of generation, hand out whatever was held back (no stop string matched)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

    def _emit(self) -> DetokenizerStep:
        # A stop string may start inside text we already held back, so search from the first
        # unemitted char minus the longest stop string.
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        first: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            at, s = first
            delta = self.text[self.emitted : max(at, self.emitted)]
            self.text = self.text[:at]
            self.emitted = len(self.text)
            return DetokenizerStep(delta, stopped_on=s)
        for pattern in self._stop_after:
            found = pattern.search(self.text)
            if found is not None:
                end = max(found.end(), self.emitted)  # text handed out is never taken back
                delta = self.text[self.emitted : end]
                self.text = self.text[:end]
                self.emitted = end
                return DetokenizerStep(delta, stopped_on=pattern.pattern)
        safe_end = len(self.text) - _longest_stop_prefix_suffix(self.text, self.stop)
        delta = self.text[self.emitted : max(safe_end, self.emitted)]
        self.emitted = max(safe_end, self.emitted)
        return DetokenizerStep(delta)


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
