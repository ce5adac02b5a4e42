"""An answer's grounding: it cites a source it was given, or refuses only where no evidence span
scores high; otherwise `grounded: false` with the reason and the best span."""

from __future__ import annotations

from prefixrag.app.schemas.query import CitationOut, EvidenceOut
from prefixrag.app.services.grounding import assess, best_support, refuses


def _citation(n: int, span_scores: list[float]) -> CitationOut:
    text = "The with statement closes the file. Use open() for it."
    evidence = [
        EvidenceOut(
            start=0, end=10, document_start=0, document_end=10, text=f"line {n}.{i}", score=s
        )
        for i, s in enumerate(span_scores)
    ]
    return CitationOut(
        n=n, document_id=n, chunk_id=10 + n, title=f"doc {n}", text=text, start=0, end=len(text),
        page=None, score=0.5, evidence=evidence,
    )  # fmt: skip


SOURCES = [_citation(1, [0.4, 0.3]), _citation(2, [0.8]), _citation(3, [])]


def test_an_answer_citing_a_given_source_is_grounded() -> None:
    out = assess("Use the with statement [2], or close() [7].", SOURCES, min_score=0.6)
    assert out.grounded and out.reason is None
    assert out.cited == [2]  # [7] was never given
    assert out.support is not None and (out.support.n, out.support.text) == (2, "line 2.0")


def test_an_answer_that_cites_nothing_is_not_grounded_and_names_the_best_line() -> None:
    for answer in ("Use the with statement.", "See source [7]."):
        out = assess(answer, SOURCES, min_score=0.6)
        assert not out.grounded and out.reason == "cites no source" and out.cited == []
        assert out.support is not None and out.support.score == 0.8


def test_a_refusal_is_grounded_only_where_no_span_scores_high() -> None:
    refusal = "The documents do not cover it."
    assert refuses(refusal) and not refuses("The documents say: use with.")
    out = assess(refusal, SOURCES, min_score=0.6)
    assert not out.grounded and out.reason is not None and "[2] scores 0.80" in out.reason
    assert assess(refusal, SOURCES, min_score=0.9).grounded
    assert assess(refusal, [], min_score=0.6).grounded  # nothing found: refusing is right


def test_with_no_sources_an_answer_is_not_grounded() -> None:
    out = assess("Paris.", [], min_score=0.6)
    assert not out.grounded and out.reason == "no sources were found" and out.support is None
    assert best_support([_citation(1, [])]) is None
