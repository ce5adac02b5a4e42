"""bench/lexical_scale_bench.py: its Python BM25 equals FTS5's bm25() chunk by chunk, and its
MaxScore search returns exactly the service's top 50 (the bench reports it as exact)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from bench import lexical_scale_bench as bench
from bench.hybrid_bench import fill
from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.lexical import SQLITE_TABLE
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import fts5_match, index_terms

# a Zipf-like vocabulary: a few words in most chunks, most words in few
WORDS = [f"w{i}" for i in range(60)]
WEIGHTS = [1 / (i + 1) for i in range(60)]


def corpus_db(tmp_path: Path) -> tuple[str, sqlite3.Connection]:
    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, WEIGHTS, k=rng.randint(3, 40))) for _ in range(120)]
    text_of = np.asarray([rng.randrange(len(texts)) for _ in range(600)])
    path = str(tmp_path / "bench.db")
    upgrade_db(f"sqlite:///{path}")
    fill(path, texts, text_of)
    db = sqlite3.connect(path)
    db.execute(f"CREATE VIRTUAL TABLE temp.vocab USING fts5vocab(main, {SQLITE_TABLE}, row)")
    db.execute("CREATE TABLE bench_df (term TEXT PRIMARY KEY, df INTEGER NOT NULL) WITHOUT ROWID")
    db.execute("INSERT INTO bench_df SELECT term, doc FROM temp.vocab")
    db.commit()
    return path, db


QUERIES = ["w0 w1 w2", "w59 w30 w0", "w5 w5 w40 w41 w1", "w10 w20 w30 w40 w50 w0 w1", "w3"]


def test_python_bm25_equals_fts5(tmp_path: Path) -> None:
    _, db = corpus_db(tmp_path)
    analyzer = Analyzer()
    for query in QUERIES:
        terms = index_terms(analyzer, query)
        stats = bench.Stats(db, terms)
        sql = f"SELECT rowid, terms, -bm25({SQLITE_TABLE}) FROM {SQLITE_TABLE} WHERE {SQLITE_TABLE} MATCH ?"  # noqa: E501
        rows = db.execute(sql, (fts5_match(terms),)).fetchall()
        assert rows
        for _, text, expected in rows:
            assert stats.score(text) == pytest.approx(expected, rel=1e-9, abs=1e-12), query


@pytest.mark.parametrize("first_postings", [1, 100, 10_000])
def test_maxscore_returns_the_exact_top_k(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_postings: int
) -> None:
    # small first rounds make the second (the terms a doc still needs) do the work
    monkeypatch.setattr(bench, "MAXSCORE_FIRST_POSTINGS", first_postings)
    monkeypatch.setattr(bench, "K", 20)
    path, db = corpus_db(tmp_path)
    engine = make_engine(f"sqlite:///{path}")
    try:
        lexical = DatabaseLexicalIndex(make_sessionmaker(engine), Analyzer())
        for query in QUERIES:
            ids, info = bench.maxscore(db, index_terms(Analyzer(), query))
            exact = lexical.search(query, 20, Scope(tenant="a"))[1].tolist()
            assert ids == exact, (query, info)
    finally:
        engine.dispose()
