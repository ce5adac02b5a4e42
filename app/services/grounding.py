"""Whether an answer rests on its sources, said beside the answer, never by rewriting it.

A small model often answers from its sources without citing them, or says the sources lack what
their best line plainly holds. The response then says `grounded: false` with the reason, and
names the best evidence span, which the web page shows under the answer as "from the sources":
the reader sees the line the answer should have rested on, in the source's own words.
"""

from __future__ import annotations

import re

from prefixrag.app.prompt.parts import NOT_IN_SOURCES
from prefixrag.app.schemas.query import CitationOut, GroundingOut, SupportOut

CITE_MARK = re.compile(r"\[(\d+)\]")


def refuses(answer: str) -> bool:
    """True when the answer opens by saying its sources lack the answer (the engine's stop rule,
    which wants a space after the sentence: a finished answer gets one)."""
    return re.match(NOT_IN_SOURCES, answer + " ", re.IGNORECASE) is not None


def best_support(citations: list[CitationOut]) -> SupportOut | None:
    """The top-scoring evidence span over every source, with its source's number."""
    spans = [(span.score, c, span) for c in citations for span in c.evidence[:1]]
    if not spans:
        return None
    score, citation, span = max(spans, key=lambda item: item[0])
    return SupportOut(n=citation.n, title=citation.title, text=span.text, score=score)


def assess(answer: str, citations: list[CitationOut], min_score: float) -> GroundingOut:
    """An answer is grounded when it cites a source it was given, or refuses where no span
    scores `min_score` or more; otherwise not, with why."""
    numbers = {c.n for c in citations}
    cited = sorted({int(n) for n in CITE_MARK.findall(answer)} & numbers)
    support = best_support(citations)
    if refuses(answer):
        if support is not None and support.score >= min_score:
            score = f"{support.score:.2f}"
            reason = f"says the sources lack it, while source [{support.n}] scores {score}"
            return GroundingOut(grounded=False, reason=reason, cited=cited, support=support)
        return GroundingOut(grounded=True, reason=None, cited=cited, support=support)
    if not citations:
        return GroundingOut(grounded=False, reason="no sources were found", cited=[], support=None)
    if not cited:
        return GroundingOut(grounded=False, reason="cites no source", cited=cited, support=support)
    return GroundingOut(grounded=True, reason=None, cited=cited, support=support)
