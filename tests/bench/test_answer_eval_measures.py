"""The answer benchmark's measures and its fixed tuning / held-out split."""

from __future__ import annotations

import json

from bench.answer_eval import DATA, holds_gold, loops, score
from bench.eval_split import HALVES, half_of, split


def test_the_split_is_fixed_by_the_question_text_and_covers_every_question():
    questions = json.loads(DATA.read_text())["questions"]
    halves = split(questions)
    assert sorted(halves) == sorted(HALVES)
    assert sum(len(v) for v in halves.values()) == len(questions)
    assert all(half_of(q["q"]) == h for h, qs in halves.items() for q in qs)
    # a question keeps its half whatever else is in the set, and whitespace around it
    assert split(list(reversed(questions))) == {h: list(reversed(v)) for h, v in halves.items()}
    assert half_of("  " + questions[0]["q"] + "\n") == half_of(questions[0]["q"])
    assert min(len(v) for v in halves.values()) > len(questions) // 3


def test_a_gold_string_is_found_across_case_and_line_breaks():
    text = "It is good PRACTICE to use\nthe  with keyword."
    assert holds_gold(text, ["good practice to use the"])
    assert not holds_gold("practice makes perfect", ["good practice"])


def test_an_answer_loops_when_six_words_come_twice():
    once = "The documents do not say who built the lighthouse."
    assert not loops(once)
    assert loops(once + " " + once)
    assert not loops("a b c d e f a b c d e g")  # five words repeated: not yet a loop
    assert loops("a b c d e f x a b c d e f")


def test_evidence_counts_each_sources_top_span_and_best_span_the_top_scoring_one():
    out = {
        "answer": "Use sorted().",
        "citations": [
            {"text": "x", "evidence": [{"score": 0.2, "text": "Return a new sorted list"}]},
            {"text": "sorted(iterable)", "evidence": [{"score": 0.9, "text": "sorted(iterable)"}]},
        ],
        "timings": {"evidence_ms": 3.0, "ttft_ms": 10.0},
        "usage": {"completion_tokens": 4},
    }
    row = score({"q": "?", "a": ["sorted(iterable"]}, out)
    assert row["evidence_ok"] and row["best_span_ok"] and row["recall"]
    assert not row["answer_ok"] and not row["loops"]
    out["citations"][1]["evidence"][0]["score"] = 0.1  # still its source's top span
    row = score({"q": "?", "a": ["sorted(iterable"]}, out)
    assert row["evidence_ok"] and not row["best_span_ok"]
    out["citations"][1]["evidence"] = []
    assert not score({"q": "?", "a": ["sorted(iterable"]}, out)["evidence_ok"]


def test_a_refusal_counts_only_where_a_source_held_the_answer():
    from bench.answer_eval import refuses, summarize

    assert refuses("The documents do not cover it.")
    assert refuses("the sources don't say. ")
    assert not refuses("It returns None [1]. The documents do not cover the rest.")
    base = {
        "answer_ok": False,
        "evidence_ok": False,
        "best_span_ok": False,
        "loops": False,
        "evidence_ms": 1.0,
        "ttft_ms": 1.0,
        "completion_tokens": 4,
    }
    rows = [
        {**base, "recall": True, "refusal": True},
        {**base, "recall": True, "refusal": False},
        {**base, "recall": False, "refusal": True},  # nothing to answer from: not counted
    ]
    assert summarize(rows)["refusals_when_recalled"] == 0.5
