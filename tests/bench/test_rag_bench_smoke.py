"""bench/rag_bench.py: the bookkeeping the report rests on, without an LLM (the real run is
`python -m bench.rag_bench --quick`)."""

from __future__ import annotations

import os

import pytest

from bench import rag_bench as rb


def test_pass_two_joins_two_pass_one_questions_of_its_page() -> None:
    doc_ids = {page: i for i, page in enumerate(rb.NEW_QUESTIONS)}
    for per_page_p1, per_page_p2 in ((4, 2), (2, 1)):  # the default and --quick
        p1, p2 = rb.new_question_passes(doc_ids, per_page_p1, per_page_p2)
        assert len(p1) == per_page_p1 * len(doc_ids)
        assert len(p2) == per_page_p2 * len(doc_ids)
        # round robin: consecutive questions come from different pages
        assert [item["page"] for item in p1[: len(doc_ids)]] == list(doc_ids)
        asked = {(item["page"], item["question"]) for item in p1}
        for item in p2:
            first, second = (rb.NEW_QUESTIONS[item["page"]][0][i] for i in item["joins"])
            assert {(item["page"], first), (item["page"], second)} <= asked
            assert item["question"] == rb.join_questions(first, second)
    assert rb.join_questions("How do I X?", "What does Y do?") == "How do I X, and what does Y do?"
    with pytest.raises(ValueError):
        rb.new_question_passes(doc_ids, 1, 1)  # pass 2 would join a question pass 1 skips


def test_seen_share_and_agreement() -> None:
    earlier = [{"question": "a", "chunk_ids": [1, 2], "answer": "x"}]
    later = [{"question": "a", "chunk_ids": [2, 3, 1, 4], "answer": "x"}]
    assert rb.seen_share(earlier, later) == 0.5
    assert rb.agreement(later, earlier) == 1.0
    assert rb.agreement([{**later[0], "answer": "y"}], earlier) == 0.0
    with pytest.raises(ValueError):
        rb.agreement([{"question": "b", "answer": "x"}], earlier)


def test_fraction_choice_looks_at_the_tuning_half_only() -> None:
    def mode(fraction: float | None, tuning: float, held_out: float) -> dict:
        return {
            "fraction": fraction,
            "tuning": tuning,
            "held_out": held_out,
            "tuning_same_as_today": 1.0,
        }

    modes = {
        "today": mode(None, 0.9, 0.9),
        "reuse@0": mode(0.0, 0.5, 1.0),  # best held out: must not matter
        "reuse@0.15": mode(0.15, 0.8, 0.2),
        "reuse@0.5": mode(0.5, 0.8, 0.6),
    }
    assert rb.choose_fraction(modes) == 0.15  # ties on tuning go to the smaller fraction
    assert rb.is_correct("use os.path.JOIN(a, b)", ["nope", "os.path.join("])
    assert not rb.is_correct("", ["x"])


def test_data_dir_copy_links_chunk_files_and_copies_the_rest(tmp_path) -> None:
    base = tmp_path / "base"
    (base / "kv_chunks" / "fp").mkdir(parents=True)
    (base / "kv_chunks" / "fp" / "a.kv").write_bytes(b"kv")
    (base / "prefixrag.db").write_bytes(b"db")
    models = tmp_path / "models"
    models.mkdir()
    rb.link_model_cache(base, models)
    copy = rb.copy_data_dir(base, tmp_path / "copy")
    assert os.path.samefile(copy / "kv_chunks" / "fp" / "a.kv", base / "kv_chunks" / "fp" / "a.kv")
    assert not os.path.samefile(copy / "prefixrag.db", base / "prefixrag.db")
    assert (copy / "cache" / "models").is_symlink()


@pytest.mark.skipif(not rb.HTML_ROOT.is_dir(), reason="needs Debian's python3.11-doc")
def test_accuracy_questions_split_by_index_parity() -> None:
    items = rb.accuracy_questions(rb.ACC_PAGES.split(","))
    halves = {item["half"] for item in items}
    assert halves == {"tuning", "held_out"}
    assert all((item["index"] % 2 == 0) == (item["half"] == "tuning") for item in items)
