"""Chunker invariants: exact offsets, token limits, overlap, sections and pages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.retrieval.chunking import Chunker
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.parsing import ParsedDocument, Section, parse_document


def count_words(text: str) -> int:
    return len(text.split())


def check_invariants(doc: ParsedDocument, chunks: list, chunker: Chunker) -> None:
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    for chunk in chunks:
        assert chunk.text == doc.text[chunk.start : chunk.end]
        assert chunk.text.strip() == chunk.text and chunk.text
        assert chunk.num_tokens == chunker.count_tokens(chunk.text)
        assert chunk.num_tokens <= chunker.chunk_tokens
    for a, b in itertools.pairwise(chunks):
        assert a.start < b.start and a.end <= b.end


words = st.text(alphabet="abcdefghij", min_size=1, max_size=12)
sentence = st.lists(words, min_size=1, max_size=30).map(lambda ws: " ".join(ws) + ".")
paragraph = st.lists(sentence, min_size=1, max_size=8).map(" ".join)
body = st.lists(paragraph, min_size=1, max_size=12).map("\n\n".join)


@settings(max_examples=60, deadline=None)
@given(body=body, chunk_tokens=st.integers(4, 80), overlap=st.integers(0, 20))
def test_invariants_and_full_coverage(body: str, chunk_tokens: int, overlap: int) -> None:
    overlap = min(overlap, chunk_tokens - 1)
    doc = ParsedDocument(body, "text/plain")
    chunker = Chunker(count_words, chunk_tokens, overlap)
    chunks = chunker.split(doc)
    check_invariants(doc, chunks, chunker)
    # every word of the document lies in some chunk
    covered = [False] * len(body)
    for c in chunks:
        covered[c.start : c.end] = [True] * (c.end - c.start)
    assert all(covered[i] for i, ch in enumerate(body) if not ch.isspace())


def test_overlap_repeats_trailing_words() -> None:
    body = " ".join(f"w{i}" for i in range(200))
    chunker = Chunker(count_words, 50, 10)
    chunks = chunker.split(ParsedDocument(body, "text/plain"))
    assert len(chunks) >= 4
    for a, b in itertools.pairwise(chunks):
        shared = a.text[b.start - a.start :]
        assert b.text.startswith(shared) and count_words(shared) == 10


def test_paragraphs_are_packed_and_never_cut_when_they_fit() -> None:
    paragraphs = [" ".join(f"p{n}w{i}" for i in range(8)) for n in range(10)]
    doc = ParsedDocument("\n\n".join(paragraphs), "text/plain")
    chunks = Chunker(count_words, 20, 0).split(doc)
    assert [c.num_tokens for c in chunks] == [16, 16, 16, 16, 16]
    assert all(c.text.count("\n\n") == 1 for c in chunks)


def test_chunks_stay_within_sections_with_heading_paths() -> None:
    text = "# A\n\nalpha text\n\n## B\n\nbeta text\n\n# C\n\ngamma text\n"
    doc = parse_document(text.encode(), "text/markdown")
    chunks = Chunker(count_words, 100, 5).split(doc)
    assert [(c.heading, c.text) for c in chunks] == [
        ("A", "# A\n\nalpha text"),
        ("A > B", "## B\n\nbeta text"),
        ("C", "# C\n\ngamma text"),
    ]


def test_text_before_first_section_has_no_heading() -> None:
    doc = ParsedDocument(
        "preface words\n\nTitle\n\nbody", "text/plain", None, [Section(15, 1, "Title")]
    )
    chunks = Chunker(count_words, 100, 0).split(doc)
    assert [(c.heading, c.text) for c in chunks] == [
        (None, "preface words"),
        ("Title", "Title\n\nbody"),
    ]


def test_pages_follow_page_starts() -> None:
    pages = [" ".join(f"page{n}word{i}" for i in range(30)) + "\n\n" for n in range(3)]
    starts = [sum(len(p) for p in pages[:n]) for n in range(3)]
    doc = ParsedDocument("".join(pages), "application/pdf", starts)
    chunks = Chunker(count_words, 10, 2).split(doc)
    for c in chunks:
        assert c.page == 1 + max(n for n in range(3) if starts[n] <= c.start)
    assert {c.page for c in chunks} == {1, 2, 3}


def test_huge_word_is_cut_at_characters() -> None:
    doc = ParsedDocument("x" * 5000, "text/plain")
    chunker = Chunker(len, 300, 0)  # one token per character
    chunks = chunker.split(doc)
    check_invariants(doc, chunks, chunker)
    assert "".join(c.text for c in chunks) == doc.text


@pytest.mark.parametrize(("size", "overlap"), [(0, 0), (10, 10), (10, -1)])
def test_bad_config(size: int, overlap: int) -> None:
    with pytest.raises(ValueError):
        Chunker(count_words, size, overlap)


def test_real_tokenizer_on_html(embedder: Embedder) -> None:
    sections = "".join(
        f"<h2>Part {n}</h2>"
        + "".join(f"<p>{f'Sentence about part {n}. ' * 25}</p>" for _ in range(3))
        for n in range(6)
    )
    doc = parse_document(f"<html><body><h1>Doc</h1>{sections}</body></html>".encode(), "text/html")
    chunker = Chunker(embedder.count_tokens, 64, 8)
    chunks = chunker.split(doc)
    check_invariants(doc, chunks, chunker)
    for c in chunks:
        part = c.heading.rsplit("Part ", 1)[-1] if c.heading and "Part" in c.heading else None
        if part is not None:
            assert f"part {part}." in c.text
