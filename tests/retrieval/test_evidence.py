"""Evidence spans: the answering sentence wins, offsets are exact, sentence vectors are cached,
and a loaded cross-encoder has the last word."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.evidence import NEVER_RESTATES, EvidenceFinder, StoredSentences
from prefixrag.retrieval.reranker import Reranker
from prefixrag.retrieval.sentences import sentence_spans
from tests.retrieval.tiny_cross_encoder import KEYWORD

NEVER = float("-inf")  # an extend_margin no neighbour passes
# single sentences only, unless a test asks for more
SINGLE = {"extend_margin": NEVER, "restate_share": NEVER_RESTATES}

LIGHTHOUSE = (
    "The lighthouse stands on a granite cliff above the harbour town. "
    "Its keeper climbed the spiral stairs every evening to light the lamp. "
    "Ships far out at sea used the beam to avoid the rocky coast during storms. "
    "In the morning he wrote the weather into a leather logbook."
)
GARDEN = (
    "Tomatoes need plenty of sun and regular watering through the summer.\n"
    "Compost and well-drained loam keep the roots healthy and free of rot.\n"
    "Aphids can be washed off the leaves with a gentle spray of soapy water."
)


class CountingEmbedder:
    """The real embedder, counting the texts it is asked to encode."""

    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder
        self.model_name_or_path = embedder.model_name_or_path
        self.dim = embedder.dim
        self.encoded: list[str] = []

    def encode(self, texts):
        self.encoded.extend(texts)
        return self._embedder.encode(texts)

    def encode_query(self, text):
        return self._embedder.encode_query(text)


def test_the_sentence_that_answers_wins_in_each_chunk(embedder: Embedder):
    finder = EvidenceFinder(max_spans=2, **SINGLE)  # single sentences only
    found = finder.find(
        "How did ships avoid the rocky coast in storms?", [LIGHTHOUSE, GARDEN], embedder=embedder
    )
    top = LIGHTHOUSE[found[0][0].start : found[0][0].end]
    assert top == "Ships far out at sea used the beam to avoid the rocky coast during storms."
    for text, spans in zip([LIGHTHOUSE, GARDEN], found, strict=True):
        assert len(spans) == 2 and spans[0].score >= spans[1].score
        assert {(s.start, s.end) for s in spans} <= set(sentence_spans(text))


def test_scores_are_the_cosine_plus_the_question_term_share(embedder: Embedder):
    question = "What keeps the roots healthy?"
    finder = EvidenceFinder(max_spans=3, term_weight=0.5, **SINGLE)
    spans = finder.find(question, [GARDEN], embedder=embedder)[0]
    q = embedder.encode_query(question)
    for span in spans:
        sentence = GARDEN[span.start : span.end]
        cosine = float(embedder.encode([sentence])[0] @ q)
        q_terms = set(finder.analyzer.terms(question))
        share = len(q_terms & set(finder.analyzer.terms(sentence))) / len(q_terms)
        # sentence vectors are kept in float16
        assert span.score == pytest.approx(cosine + 0.5 * share, abs=2e-3)
    assert GARDEN[spans[0].start : spans[0].end].startswith("Compost")


def test_a_neighbour_within_the_margin_widens_the_span(embedder: Embedder):
    question = "How did ships avoid the rocky coast in storms?"
    narrow = EvidenceFinder(max_spans=1, **SINGLE).find(question, [LIGHTHOUSE], embedder=embedder)[
        0
    ][0]
    wide = EvidenceFinder(max_spans=1, extend_margin=10.0).find(
        question, [LIGHTHOUSE], embedder=embedder
    )[0][0]
    assert wide.start <= narrow.start and narrow.end <= wide.end
    assert (wide.end - wide.start) > (narrow.end - narrow.start)
    assert (wide.start, wide.end) != (narrow.start, narrow.end)


def test_a_sentence_that_points_back_takes_the_one_before_it(embedder: Embedder):
    question = "Who climbed the spiral stairs every evening to light the lamp?"
    sentences = sentence_spans(LIGHTHOUSE)
    assert LIGHTHOUSE[slice(*sentences[1])].startswith("Its keeper")
    alone = EvidenceFinder(max_spans=1, **SINGLE, widen_back=False)
    assert alone.find(question, [LIGHTHOUSE], embedder=embedder)[0][0].start == sentences[1][0]
    back = EvidenceFinder(max_spans=1, **SINGLE)
    span = back.find(question, [LIGHTHOUSE], embedder=embedder)[0][0]
    assert (span.start, span.end) == (sentences[0][0], sentences[1][1])  # two sentences, no more


NOTES = (
    "When an exception is created in order to be raised, it is usually initialized with "
    "information that describes the error that has occurred. "
    "There are cases where it is useful to add information after the exception was caught. "
    "For this purpose, exceptions have a method add_note(note) that accepts a string and adds "
    "it to the exception's notes list."
)


def scores_by_span(finder: EvidenceFinder, question: str, text: str, embedder: Embedder):
    return {(s.start, s.end): s.score for s in finder.find(question, [text], embedder=embedder)[0]}


def test_naming_code_the_question_does_not_adds_the_code_weight(embedder: Embedder):
    question = "How do I add extra information to an exception after catching it?"
    plain = EvidenceFinder(max_spans=3, code_weight=0.0, **SINGLE, widen_back=False)
    coded = EvidenceFinder(max_spans=3, code_weight=0.25, **SINGLE, widen_back=False)
    before = {
        (s.start, s.end): s.score for s in plain.find(question, [NOTES], embedder=embedder)[0]
    }
    after = {(s.start, s.end): s.score for s in coded.find(question, [NOTES], embedder=embedder)[0]}
    assert before.keys() == after.keys() == set(sentence_spans(NOTES))
    for (lo, hi), score in after.items():
        names_code = "add_note(" in NOTES[lo:hi]
        assert score == pytest.approx(before[(lo, hi)] + (0.25 if names_code else 0.0), abs=1e-6)
    # the embedder alone prefers the sentence that restates the question; the bonus lets the
    # one that answers it win
    best = max(before, key=before.__getitem__)
    assert NOTES[slice(*best)].startswith("There are cases")
    shipped = EvidenceFinder(max_spans=1, **SINGLE)
    top = shipped.find(question, [NOTES], embedder=embedder)[0][0]
    assert "add_note(note)" in NOTES[top.start : top.end]


def test_code_named_by_the_question_earns_no_bonus(embedder: Embedder):
    question = "What does add_note(note) do to an exception?"
    plain = EvidenceFinder(max_spans=3, code_weight=0.0, **SINGLE, widen_back=False)
    coded = EvidenceFinder(max_spans=3, code_weight=0.25, **SINGLE, widen_back=False)
    assert coded.find(question, [NOTES], embedder=embedder) == plain.find(
        question, [NOTES], embedder=embedder
    )


def test_sentence_vectors_are_cached_per_chunk_and_evicted_oldest_first(embedder: Embedder):
    counting = CountingEmbedder(embedder)
    finder = EvidenceFinder(cache_chunks=1)
    first = finder.find("Where is the lighthouse?", [LIGHTHOUSE], embedder=counting)  # type: ignore[arg-type]
    assert len(counting.encoded) == len(sentence_spans(LIGHTHOUSE))
    again = finder.find("Where is the lighthouse?", [LIGHTHOUSE], embedder=counting)  # type: ignore[arg-type]
    assert again == first and len(counting.encoded) == len(sentence_spans(LIGHTHOUSE))
    finder.find("What do tomatoes need?", [GARDEN], embedder=counting)  # type: ignore[arg-type]
    finder.find("Where is the lighthouse?", [LIGHTHOUSE], embedder=counting)  # type: ignore[arg-type]
    expected = 2 * len(sentence_spans(LIGHTHOUSE)) + len(sentence_spans(GARDEN))
    assert len(counting.encoded) == expected  # the one-chunk cache dropped the lighthouse


def test_a_warmed_chunk_costs_no_embedding_at_question_time(embedder: Embedder):
    counting = CountingEmbedder(embedder)
    finder = EvidenceFinder()
    finder.warm([LIGHTHOUSE, GARDEN], counting)  # type: ignore[arg-type]
    warmed = len(counting.encoded)
    assert finder.num_cached == 2 and warmed == len(sentence_spans(LIGHTHOUSE)) + len(
        sentence_spans(GARDEN)
    )
    finder.find("What keeps roots healthy?", [GARDEN, LIGHTHOUSE], embedder=counting)  # type: ignore[arg-type]
    assert len(counting.encoded) == warmed


def test_stored_sentences_restore_a_new_finder_without_embedding(embedder: Embedder):
    counting = CountingEmbedder(embedder)
    first = EvidenceFinder()
    stored = first.stored([LIGHTHOUSE, GARDEN], counting)  # type: ignore[arg-type]
    for text, saved in zip([LIGHTHOUSE, GARDEN], stored, strict=True):
        assert saved.spans.tolist() == [list(span) for span in sentence_spans(text)]
        assert saved.vectors.shape == (len(saved.spans), embedder.dim)
    question = "What keeps roots healthy?"
    expected = first.find(question, [GARDEN, LIGHTHOUSE], embedder=counting)  # type: ignore[arg-type]
    embedded = len(counting.encoded)
    # a restarted service: an empty cache, and the stored rows
    fresh = EvidenceFinder()
    assert fresh.missing([LIGHTHOUSE, GARDEN], counting) == [0, 1]  # type: ignore[arg-type]
    assert fresh.restore([LIGHTHOUSE, GARDEN], stored, counting) == 2  # type: ignore[arg-type]
    assert fresh.missing([LIGHTHOUSE, GARDEN], counting) == []  # type: ignore[arg-type]
    assert fresh.find(question, [GARDEN, LIGHTHOUSE], embedder=counting) == expected  # type: ignore[arg-type]
    assert len(counting.encoded) == embedded
    # rows that no longer fit are not taken: another text, splitting or embedder width
    narrow = StoredSentences(stored[0].key, stored[0].spans, stored[0].vectors[:, :8])
    for finder, text, saved in [
        (EvidenceFinder(), GARDEN, stored[0]),
        (EvidenceFinder(code_aware_split=False), LIGHTHOUSE, stored[0]),
        (EvidenceFinder(), LIGHTHOUSE, narrow),
        (EvidenceFinder(), LIGHTHOUSE, None),
    ]:
        assert finder.restore([text], [saved], counting) == 0  # type: ignore[arg-type]
        assert finder.missing([text], counting) == [0]  # type: ignore[arg-type]


def test_texts_without_sentences_get_no_spans(embedder: Embedder):
    found = EvidenceFinder().find("anything?", ["", " --- ", GARDEN], embedder=embedder)
    assert found[0] == found[1] == [] and len(found[2]) == 2


@pytest.mark.slow  # trains the tiny cross-encoder first
def test_a_loaded_cross_encoder_orders_the_shortlist(embedder: Embedder, tiny_cross_encoder: Path):
    reranker = Reranker(str(tiny_cross_encoder), device="cpu")
    assert reranker.is_available
    text = (
        "The river runs past the stone bridge near the old castle walls.\n"
        f"A {KEYWORD} tree grows in the garden behind the window of the house.\n"
        "The forest beyond the desert is home to a tiger and its cubs."
    )
    finder = EvidenceFinder(max_spans=3, **SINGLE)
    spans = finder.find("river stone bridge castle", [text], embedder=embedder, reranker=reranker)[
        0
    ]
    assert KEYWORD in text[spans[0].start : spans[0].end]
    pairs = [text[s.start : s.end] for s in spans]
    expected = reranker.score("river stone bridge castle", pairs)
    assert expected is not None
    # padding differs between the two batches: scores agree to float32 noise, not bit for bit
    np.testing.assert_allclose([s.score for s in spans], expected, atol=1e-2)


def test_the_finder_splits_code_aware_and_caches_each_splitting_apart(embedder: Embedder):
    text = (
        ">>> f.close()\n"
        "Traceback (most recent call last):\n"
        '  File "<stdin>", line 1, in <module>\n'
        "It is good practice to use the with keyword when dealing with file objects.\n"
        "Using with is also much shorter than writing equivalent try-finally blocks."
    )
    question = "What is good practice when dealing with file objects?"
    aware = EvidenceFinder(max_spans=1, **SINGLE, widen_back=False)
    glued = EvidenceFinder(max_spans=1, **SINGLE, widen_back=False, code_aware_split=False)
    glued._cache = aware._cache  # one cache, as bench/evidence_eval.py shares it
    top = aware.find(question, [text], embedder=embedder)[0][0]
    assert text[top.start : top.end] == (
        "It is good practice to use the with keyword when dealing with file objects."
    )
    top = glued.find(question, [text], embedder=embedder)[0][0]
    assert text[top.start : top.end].startswith('File "<stdin>"')
    assert aware.num_cached == 2  # the same text, split two ways


STACK = (
    "5.1.1. Using Lists as Stacks\n\n"
    "The list methods make it very easy to use a list as a stack, where the last element added "
    "is the first element retrieved (last-in, first-out). "
    "To add an item to the top of the stack, use append(). "
    "To retrieve an item from the top of the stack, use pop() without an explicit index."
)
STACK_QUESTION = "How can a list be used as a last-in, first-out stack?"


def test_a_sentence_that_restates_the_question_takes_the_next_one_along(embedder: Embedder):
    restating, answering, _ = sentence_spans(STACK)
    assert STACK[slice(*restating)].startswith("The list methods")
    alone = EvidenceFinder(max_spans=1, **SINGLE, widen_back=False)
    top = alone.find(STACK_QUESTION, [STACK], embedder=embedder)[0][0]
    assert (top.start, top.end) == restating  # restating wins, and alone misses the answer
    for share in (0.7, 0.5):  # it holds 0.8 of the question's terms
        finder = EvidenceFinder(max_spans=1, extend_margin=NEVER, restate_share=share)
        top = finder.find(STACK_QUESTION, [STACK], embedder=embedder)[0][0]
        assert (top.start, top.end) == (restating[0], answering[1])
    strict = EvidenceFinder(max_spans=1, extend_margin=NEVER, restate_share=0.9)
    top = strict.find(STACK_QUESTION, [STACK], embedder=embedder)[0][0]
    assert (top.start, top.end) == restating


def test_a_restating_sentence_takes_no_code_along(embedder: Embedder):
    text = STACK.replace(" To add an item", "\n>>> stack = [3, 4, 5]\nTo add an item")
    restating, code, *_ = sentence_spans(text)
    assert text[slice(*code)] == ">>> stack = [3, 4, 5]"
    finder = EvidenceFinder(max_spans=1, extend_margin=NEVER, restate_share=0.7)
    top = finder.find(STACK_QUESTION, [text], embedder=embedder)[0][0]
    assert (top.start, top.end) == restating


def test_a_numbered_heading_is_never_highlighted_and_splits_apart_in_the_cache(
    embedder: Embedder,
):
    finder = EvidenceFinder(max_spans=3, **SINGLE)
    glued = EvidenceFinder(max_spans=3, **SINGLE, skip_headings=False)
    glued._cache = finder._cache  # one cache, as bench/evidence_eval.py shares it
    spans = finder.find(STACK_QUESTION, [STACK], embedder=embedder)[0]
    assert all("5.1.1." not in STACK[s.start : s.end] for s in spans)
    spans = glued.find(STACK_QUESTION, [STACK], embedder=embedder)[0]
    assert any(STACK[s.start : s.end].startswith("5.1.1. Using") for s in spans)
    assert finder.num_cached == 2


def test_a_line_of_code_can_be_kept_from_the_code_bonus(embedder: Embedder):
    text = (
        "It is good practice to use the with keyword when dealing with file objects.\n"
        ">>> with open('workfile', encoding='utf-8') as f:\n"
        "...     read_data = f.read()"
    )
    question = "How should I open a file?"
    prose, first, second = sentence_spans(text)
    on = scores_by_span(EvidenceFinder(max_spans=3, **SINGLE), question, text, embedder)
    off = scores_by_span(
        EvidenceFinder(max_spans=3, **SINGLE, code_bonus_on_code=False), question, text, embedder
    )
    for code in (first, second):  # each names code the question does not
        assert on[code] == pytest.approx(off[code] + 0.3, abs=1e-6)
    assert on[prose] == pytest.approx(off[prose], abs=1e-6)


def test_restate_share_must_be_positive():
    with pytest.raises(ValueError, match="restate_share"):
        EvidenceFinder(restate_share=0.0)
