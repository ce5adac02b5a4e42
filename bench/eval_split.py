"""The tuning and held-out halves of an eval set, fixed by each question's text.

A question's half is decided by a hash of its text, not by its position, so adding questions
never moves an old one across. Settings are chosen on "tune" and reported on "held_out".
"""

from __future__ import annotations

import hashlib

HALVES = ("tune", "held_out")


def half_of(question: str) -> str:
    """'tune' or 'held_out' for this question text."""
    digest = hashlib.sha256(question.strip().encode()).digest()
    return HALVES[digest[0] & 1]


def split(questions: list[dict], key: str = "q") -> dict[str, list[dict]]:
    """The questions of each half, in their original order."""
    halves: dict[str, list[dict]] = {half: [] for half in HALVES}
    for question in questions:
        halves[half_of(question[key])].append(question)
    return halves
