"""Sentence spans: exact offsets, breaks at lines and stops, abbreviations, short fragments."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixrag.retrieval.sentences import MAX_JOINED_CHARS, sentence_spans


def texts(text: str) -> list[str]:
    return [text[lo:hi] for lo, hi in sentence_spans(text)]


def test_prose_splits_at_each_stop_followed_by_a_new_sentence():
    text = (
        "The pass statement does nothing at all here. It can be used when a statement is "
        "required! Is that all there is to know? Yes, that is all of it."
    )
    assert texts(text) == [
        "The pass statement does nothing at all here.",
        "It can be used when a statement is required!",
        "Is that all there is to know? Yes, that is all of it.",  # the first is short: joined
    ]


def test_abbreviations_and_initials_do_not_end_a_sentence():
    text = (
        "Use a container, e.g. a list or a tuple, for the values you keep around. "
        "The module was written by J. Smith for the standard library of the language."
    )
    assert texts(text) == [
        "Use a container, e.g. a list or a tuple, for the values you keep around.",
        "The module was written by J. Smith for the standard library of the language.",
    ]


def test_a_line_break_always_ends_a_span_but_a_signature_joins_its_description():
    text = (
        "sorted(iterable, /, *, key=None, reverse=False)\n"
        "Return a new sorted list from the items in iterable.\n\n"
        "  - first item of a list that is long enough to stand on its own line;\n"
        "  - second item of the same list, also long enough to stand alone.\n"
    )
    assert texts(text) == [
        "sorted(iterable, /, *, key=None, reverse=False)\n"
        "Return a new sorted list from the items in iterable.",
        "- first item of a list that is long enough to stand on its own line;",
        "- second item of the same list, also long enough to stand alone.",
    ]


TRACEBACK_THEN_PROSE = (
    ">>> try:\n"
    "...     raise KeyboardInterrupt\n"
    "Traceback (most recent call last):\n"
    '  File "<stdin>", line 2, in <module>\n'
    "If a finally clause is present, the finally clause will execute as the last task.\n"
)


def test_prose_after_a_code_block_stands_alone():
    # the code lines end with no stop, so they join each other; the prose after them does not
    *code, prose = texts(TRACEBACK_THEN_PROSE)
    assert (
        prose == "If a finally clause is present, the finally clause will execute as the last task."
    )
    assert code[0].startswith(">>> try:") and not any("finally" in line for line in code)
    # before code lines were told apart, the sentence was glued to the traceback's tail
    old = [
        TRACEBACK_THEN_PROSE[lo:hi]
        for lo, hi in sentence_spans(TRACEBACK_THEN_PROSE, code_aware=False)
    ]
    assert old[-1].startswith('File "<stdin>"') and old[-1].endswith("as the last task.")


def test_prose_that_introduces_code_still_joins_it():
    text = "For example:\n>>> while True:\n...     pass\nThis is commonly used for minimal classes."
    assert texts(text) == [
        "For example:\n>>> while True:\n...     pass",
        "This is commonly used for minimal classes.",
    ]


def test_text_without_words_has_no_spans():
    assert sentence_spans("") == []
    assert sentence_spans("  \n --- \n ... \n") == []


@given(st.text(alphabet=st.sampled_from("ab .!?\n\t(\"'Ee.g"), max_size=300))
def test_spans_are_ordered_disjoint_stripped_and_hold_a_word(text: str):
    spans = sentence_spans(text)
    last = 0
    for lo, hi in spans:
        assert last <= lo < hi <= len(text)
        piece = text[lo:hi]
        assert piece == piece.strip() and any(c.isalnum() for c in piece)
        last = hi


@given(st.lists(st.text(alphabet="abcdefgh ", min_size=1, max_size=60), max_size=20))
def test_joined_spans_stay_short_enough_to_read_as_one_highlight(lines: list[str]):
    text = "\n".join(lines)
    for lo, hi in sentence_spans(text):
        # a span longer than the limit is never a join: it is one line as it was written
        assert hi - lo <= MAX_JOINED_CHARS or "\n" not in text[lo:hi]


SECTIONS = (
    "5.1.1. Using Lists as Stacks\n\n"
    "The list methods make it very easy to use a list as a stack.\n"
    "1. Open the file\n\n"
    "5.1.2. Using Lists as Queues\n\n"
    "It is also possible to use a list as a queue."
)


def test_a_numbered_heading_is_in_no_span_and_no_span_joins_across_it():
    assert texts(SECTIONS) == [
        "The list methods make it very easy to use a list as a stack.",
        "1. Open the file",  # a one-level number is a list's step, not a heading: it stays
        "It is also possible to use a list as a queue.",
    ]
    # before, each heading was glued to the sentence after it, and the dangling step to both
    assert [SECTIONS[lo:hi] for lo, hi in sentence_spans(SECTIONS, skip_headings=False)] == [
        "5.1.1. Using Lists as Stacks\n\nThe list methods make it very easy to use a list as a "
        "stack.",
        "1. Open the file\n\n5.1.2. Using Lists as Queues\n\nIt is also possible to use a list as "
        "a queue.",
    ]


def test_a_numbered_line_that_ends_a_sentence_or_a_paragraph_is_no_heading():
    text = (
        "2.5. The value is computed twice, once for each of the calls.\n\n"
        "3.1. See below\nwhere the rest follows."
    )
    assert texts(text) == [
        "2.5. The value is computed twice, once for each of the calls.",
        "3.1. See below\nwhere the rest follows.",
    ]
