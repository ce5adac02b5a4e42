"""An answer that says the sources do not hold the answer says it once: it ends after that
first sentence (the NOT_IN_SOURCES pattern every Q&A answer stops after), and a question the
model starts writing on its own ends it too."""

from __future__ import annotations

import re

import pytest

from prefixrag.app.prompt.parts import ANSWER_STOP, NOT_IN_SOURCES
from prefixrag.engine.detokenizer import IncrementalDetokenizer

# Answers the packaged model gave on bench/answer_eval.py's questions, and what is left of them.
CUT = [
    (
        "The document does not provide a specific answer to this question. The document does "
        "not mention any other questions related to this topic.",
        "The document does not provide a specific answer to this question.",
    ),
    (
        "The document does not provide a function to check whether a path exists on disk.\n\n"
        "The document does provide a function that can be used to check whether the path "
        "exists on a file system.",
        "The document does not provide a function to check whether a path exists on disk.",
    ),
    (
        "The documents do not say who built the lighthouse in Python 3.11. They say it twice.",
        "The documents do not say who built the lighthouse in Python 3.11.",
    ),
    ("  The sources don't cover it! Sorry.", "  The sources don't cover it!"),
    (
        'The document does not specify what is meant by "return statement\'s execution."\n\n'
        "The document does specify that the finally clause will execute.",
        'The document does not specify what is meant by "return statement\'s execution."',
    ),
]
# Answers that must be left whole: an answer, or a refusal that is not the first sentence.
KEPT = [
    "The pass statement does nothing [1]. It can be used when a statement is required.",
    "The document describes the with statement. It does not close files by itself.",
    "Use the with keyword [2]. The documents do not cover older ways. Nor do they say more.",
    "Documentation does not matter here.",
]


def stream(text: str) -> str:
    """The text as the engine's detokenizer hands it out with the Q&A stops, char by char."""
    chars = list(text)
    detok = IncrementalDetokenizer(
        lambda ids: "".join(chars[i] for i in ids), ANSWER_STOP, [NOT_IN_SOURCES]
    )
    shown = []
    for i in range(len(chars)):
        step = detok.add(i)
        shown.append(step.delta)
        if step.stopped_on is not None:
            return "".join(shown)
    return "".join(shown) + detok.flush()


@pytest.mark.parametrize(("answer", "left"), CUT)
def test_a_refusal_is_said_once(answer: str, left: str):
    assert stream(answer) == left


@pytest.mark.parametrize("answer", KEPT)
def test_other_answers_are_left_whole(answer: str):
    assert re.search(NOT_IN_SOURCES, answer) is None
    assert stream(answer) == answer


def test_a_question_the_model_starts_on_its_own_ends_the_answer():
    answer = "The tool is pip [1].\n\nQuestion: What is the purpose of __init__.py?"
    assert stream(answer) == "The tool is pip [1].\n"
