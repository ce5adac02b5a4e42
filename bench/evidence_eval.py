"""Evidence spans offline: the finder's settings scored on the sources /v1/query cites, no LLM.

Evidence accuracy is bench/answer_eval.py's: a gold string in the top evidence span of some
cited source, over source recall (a gold string in some cited source). The cited sources depend
only on retrieval, so they are fetched once through /v1/query (max_tokens=1: no answer is
generated) and kept in bench/.cache; each setting in SETTINGS then re-scores them with its own
EvidenceFinder in seconds. Settings are chosen on the tuning half (the default) and confirmed
on the held-out one. The median length of the top spans is reported beside each, so a setting
cannot win by highlighting more text.

    python -m bench.evidence_eval [--half tune|held_out] [--settings shipped,...] [--refresh]
                                  [--first N] [--suffix _name]

`--first 69` scores the questions the set had before issue 19 added 57 (appended at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.answer_eval import DATA, RESULTS, eval_client, holds_gold, kept_corpus
from bench.eval_split import HALVES, half_of
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.evidence import NEVER_RESTATES, EvidenceFinder

NEVER = float("-inf")  # an extend_margin no neighbour passes
# the finder before issue 19: headings glued to the next sentence, no restating
BEFORE_19: dict[str, Any] = {"skip_headings": False, "restate_share": NEVER_RESTATES}

# EvidenceFinder arguments per setting; "shipped" is the finder's defaults, and settings that
# name no round are changes to the shipped finder of their time (which the results file shows).
SETTINGS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "before": {"code_weight": 0.0, "widen_back": False, "code_aware_split": False, **BEFORE_19},
    "no_code_split": {"code_aware_split": False, **BEFORE_19},  # round 2: prose may join code
    "before19": BEFORE_19,  # round 3's finder
    "single": {"extend_margin": NEVER, "widen_back": False},
    "no_terms": {"term_weight": 0.0},
    "no_code": {"code_weight": 0.0},
    "no_back": {"widen_back": False},
    "code0.2": {"code_weight": 0.2},
    "code0.4": {"code_weight": 0.4},
    "terms0.6": {"term_weight": 0.6},
    "margin0.2": {"extend_margin": 0.2},
    # issue 19, on the tune half grown by 57 questions: changes to round 3's finder
    "headings": {**BEFORE_19, "skip_headings": True},
    "no_code_on_code": {**BEFORE_19, "code_bonus_on_code": False},
    "headings+no_code_on_code": {**BEFORE_19, "skip_headings": True, "code_bonus_on_code": False},
    "restate0.6": {**BEFORE_19, "restate_share": 0.6},
    "restate0.7": {**BEFORE_19, "restate_share": 0.7},
    "restate0.8": {**BEFORE_19, "restate_share": 0.8},
    "headings+restate0.6": {"skip_headings": True, "restate_share": 0.6},
    "headings+restate0.7": {"skip_headings": True, "restate_share": 0.7},  # shipped since
    "headings+restate0.8": {"skip_headings": True, "restate_share": 0.8},
    "headings+no_terms": {**BEFORE_19, "skip_headings": True, "term_weight": 0.0},
    "headings+restate0.7+terms0.15": {
        "skip_headings": True,
        "restate_share": 0.7,
        "term_weight": 0.15,
    },
}


def cited_sources(spec: dict, refresh: bool) -> list[dict[str, Any]]:
    """Per question of the eval set: its text, gold strings, half and cited source texts. Only
    questions not fetched before are asked (all with `refresh`): retrieval is deterministic on
    the kept corpus, and growing the eval set should not re-ask the old questions."""
    path = kept_corpus(spec).with_name(kept_corpus(spec).name + "-cited.json")
    fetched = {} if refresh or not path.is_file() else _by_question(json.loads(path.read_text()))
    missing = [q for q in spec["questions"] if q["q"] not in fetched]
    if missing:
        with eval_client(spec, kept_corpus(spec)) as client:
            for question in tqdm(missing, desc="citations"):
                body = {"question": question["q"], "temperature": 0, "max_tokens": 1}
                response = client.post("/v1/query", json=body)
                response.raise_for_status()
                fetched[question["q"]] = [c["text"] for c in response.json()["citations"]]
        path.write_text(json.dumps([{"q": q, "cited": cited} for q, cited in fetched.items()]))
    # gold strings and halves come from the eval set as it is now
    return [{**q, "half": half_of(q["q"]), "cited": fetched[q["q"]]} for q in spec["questions"]]


def _by_question(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {row["q"]: row["cited"] for row in rows}


def evaluate(finder: EvidenceFinder, questions: list[dict], embedder: Embedder) -> dict:
    """Evidence accuracy, source recall, their ratio, the top spans' median length and the
    finder's median time per question (its sentence cache warm, as ingest leaves it, and the
    question's vector given, as retrieval hands it over)."""
    recall = evidence = 0
    lengths: list[int] = []
    times: list[float] = []
    for question in questions:
        texts = question["cited"]
        vector = question["vector"]
        started = time.perf_counter()
        found = finder.find(question["q"], texts, embedder=embedder, question_vector=vector)
        times.append(time.perf_counter() - started)
        tops = [text[s[0].start : s[0].end] for text, s in zip(texts, found, strict=True) if s]
        lengths += [len(top) for top in tops]
        recall += any(holds_gold(text, question["a"]) for text in texts)
        evidence += any(holds_gold(top, question["a"]) for top in tops)
    return {
        "questions": len(questions),
        "source_recall": recall / len(questions),
        "evidence_accuracy": evidence / len(questions),
        "evidence_over_recall": evidence / recall if recall else 0.0,
        "top_span_chars_median": float(np.median(lengths)) if lengths else 0.0,
        "find_ms_p50": 1000 * float(np.median(times)) if times else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--half", choices=HALVES, default="tune")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=", ".join(SETTINGS))
    parser.add_argument("--refresh", action="store_true", help="fetch the citations again")
    parser.add_argument(
        "--first", type=int, default=0, help="the eval set's first N questions only (0: all)"
    )
    parser.add_argument("--suffix", default="", help="appended to the result file name")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    spec = json.loads(DATA.read_text())
    asked = cited_sources(spec, args.refresh)[: args.first or None]
    questions = [q for q in asked if q["half"] == args.half]
    embedder = Embedder(packaged_embedder_path())
    shared = EvidenceFinder()  # one sentence cache for every setting: same embedder, same texts
    for question in questions:
        question["vector"] = embedder.encode_query(question["q"])
    summary = {}
    for name in names:
        finder = EvidenceFinder(**SETTINGS[name])
        finder._cache = shared._cache  # a bench sharing one sentence cache on purpose
        finder.warm([text for q in questions for text in q["cited"]], embedder)  # as ingest does
        summary[name] = evaluate(finder, questions, embedder)
    report = {
        "half": args.half,
        "questions": f"first {args.first}" if args.first else "all",
        "settings": {n: SETTINGS[n] for n in names},
        "summary": summary,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"evidence_eval_{args.half}{args.suffix}.json"
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{args.half} half, {len(questions)} questions")
    print(f"{'setting':14} {'evid.':>7} {'recall':>7} {'ev/rec':>7} {'chars':>6} {'ms p50':>7}")
    for name, s in summary.items():
        print(
            f"{name:14} {s['evidence_accuracy']:7.3f} {s['source_recall']:7.3f} "
            f"{s['evidence_over_recall']:7.3f} {s['top_span_chars_median']:6.0f} "
            f"{s['find_ms_p50']:7.1f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
