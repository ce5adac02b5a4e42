"""Where FTS5's BM25 spends its time at a million chunks, and what the ways around it give.

    python -m bench.lexical_scale_bench [--total 1000000] [--queries 20] [--tmp DIR]

The database is bench/hybrid_bench.py's (two tenants, the real Debian chunk texts repeated, their
FTS5 terms); the queries are its held-out ones; every search is scoped to tenant "a" and asks for
the 50 best (the service's candidate count). Per query:

- service: today's search (app/services/lexical.py: FTS5 MATCH of every query term, OR, bm25()
  for every match, filters joined, ORDER BY, LIMIT), the exact answer the others are held to;
- parts of it: the match alone (count(*): FTS5 walking the doclists, no scoring) and bm25()
  with ORDER BY and LIMIT but no filter joins;
- maxscore (exact): the rarest terms' matches scored in Python with every term, then the terms
  a doc would need to reach the 50th score (MaxScore's bound: a term adds at most
  idf * (k1 + 1)), so the top 50 is provably BM25's. Needs each term's document frequency cheaply:
  this bench keeps them in a table built once from fts5vocab (per-term fts5vocab lookups walk
  the doclists and cost as much as the search);
- pruned (approximate): the terms in more than 5% of the chunks dropped, the rest searched as
  today;
- rare-first (approximate): FTS5's bm25() over the rarest terms only (up to 5,000 postings), its
  400 best rescored in Python with every term.
For the approximate ones, overlap@50 with the exact top 50 says what they lose. The query
embedding (the packaged MiniLM on CPU) is timed too, apart from the searches.

Writes bench/results/lexical_scale_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.ann_corpus import QUERY_WORDS, base_texts, query_chunks
from bench.hybrid_bench import fill
from bench.scale_cli import run_in_tmp, scale_parser
from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.lexical import SQLITE_TABLE
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.terms import BM25_B, BM25_K1, fts5_match, index_terms

RESULTS = Path(__file__).parent / "results" / "lexical_scale_bench.json"
K = 50
PRUNE_DF_SHARE = 0.05
RARE_POSTINGS = 5_000
RARE_RESCORED = 400
MAXSCORE_FIRST_POSTINGS = 10_000

_SCOPED = f"""SELECT f.rowid{{cols}} FROM {SQLITE_TABLE} AS f
JOIN chunks ON chunks.id = f.rowid JOIN documents ON documents.id = chunks.document_id
JOIN collections ON collections.id = documents.collection_id
WHERE documents.status = 'ready' AND collections.tenant = 'a' AND {SQLITE_TABLE} MATCH ?"""


_TENANT_A_IDS = """SELECT chunks.id FROM chunks JOIN documents ON documents.id = chunks.document_id
JOIN collections ON collections.id = documents.collection_id
WHERE documents.status = 'ready' AND collections.tenant = 'a'"""


class Stats:
    """BM25's corpus figures for one query: N, the average length, each term's df and idf, and
    its weight (query count * idf * (k1 + 1)), also its MaxScore upper bound."""

    def __init__(self, db: sqlite3.Connection, terms: list[str]) -> None:
        self.qtf = Counter(terms)
        self.num_docs, num_tokens = _varints(
            db.execute(f"SELECT block FROM {SQLITE_TABLE}_data WHERE id = 1").fetchone()[0]
        )[:2]
        self.avg_len = num_tokens / self.num_docs
        marks = ",".join("?" * len(self.qtf))
        self.df = dict(
            db.execute(
                f"SELECT term, df FROM bench_df WHERE term IN ({marks})", list(self.qtf)
            ).fetchall()
        )
        self.weight = {
            t: self.qtf[t] * _idf(self.num_docs, df) * (BM25_K1 + 1)
            for t, df in self.df.items()
            if df > 0
        }
        # rarest (largest bound) first
        self.order = sorted(self.weight, key=lambda t: (-self.weight[t], t))

    def score(self, terms_text: str) -> float:
        """The chunk's BM25 over every query term, from its stored terms."""
        words = terms_text.split()
        norm = BM25_K1 * (1 - BM25_B + BM25_B * len(words) / self.avg_len)
        total = 0.0
        for t in self.order:
            tf = words.count(t)
            if tf:
                total += self.weight[t] * tf / (tf + norm)
        return total


def _idf(n: int, df: int) -> float:
    return max(math.log((n - df + 0.5) / (df + 0.5)), 1e-6)


def _varints(blob: bytes) -> list[int]:
    """SQLite varints (FTS5's averages record: rows, then tokens per column)."""
    out, value = [], 0
    for byte in blob:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            out.append(value)
            value = 0
    return out


def _or(terms: list[str], qtf: Counter[str]) -> str:
    return fts5_match([t for t in terms for _ in range(qtf[t])])


def _top(scored: dict[int, float]) -> list[tuple[int, float]]:
    return heapq.nlargest(K, scored.items(), key=lambda x: (x[1], -x[0]))


def maxscore(db: sqlite3.Connection, terms: list[str]) -> tuple[list[int], dict]:
    """Exact top K: score the rarest terms' matches, then every doc that could still pass."""
    stats = Stats(db, terms)
    scored: dict[int, float] = {}

    def score_matches(chosen: list[str]) -> int:
        rows = db.execute(_SCOPED.format(cols=", f.terms"), (_or(chosen, stats.qtf),)).fetchall()
        for chunk_id, text in rows:
            if chunk_id not in scored:
                scored[chunk_id] = stats.score(text)
        return len(rows)

    order, bound = stats.order, [stats.weight[t] for t in stats.order]
    first = 1
    while (
        first < len(order)
        and sum(stats.df[t] for t in order[: first + 1]) <= MAXSCORE_FIRST_POSTINGS
    ):
        first += 1
    rows = score_matches(order[:first])
    top = _top(scored)
    threshold = top[-1][1] if len(top) == K else 0.0
    # a doc matching none of order[:needed] scores below sum(bound[needed:]) < threshold
    needed = first
    while needed < len(order) and sum(bound[needed:]) >= threshold:
        needed += 1
    if needed > first:
        rows += score_matches(order[first:needed])
    info = {"terms": len(order), "first_terms": first, "terms_needed": needed, "rows_scored": rows}
    return [i for i, _ in _top(scored)], info


def pruned(db: sqlite3.Connection, terms: list[str]) -> list[int]:
    """Today's query without the terms in more than PRUNE_DF_SHARE of the chunks."""
    stats = Stats(db, terms)
    kept = [t for t in terms if 0 < stats.df.get(t, 0) <= PRUNE_DF_SHARE * stats.num_docs]
    if not kept:
        return []
    sql = _SCOPED.format(cols="") + f" ORDER BY bm25({SQLITE_TABLE}), f.rowid LIMIT {K}"
    return [r[0] for r in db.execute(sql, (fts5_match(kept),))]


def rare_first(db: sqlite3.Connection, terms: list[str], allowed: np.ndarray) -> list[int]:
    """bm25() over the rarest terms, its best RARE_RESCORED rescored with every term."""
    stats = Stats(db, terms)
    order = stats.order
    num = 1
    while num < len(order) and sum(stats.df[t] for t in order[: num + 1]) <= RARE_POSTINGS:
        num += 1
    sql = (
        f"SELECT rowid, terms FROM {SQLITE_TABLE} WHERE {SQLITE_TABLE} MATCH ? "
        f"ORDER BY rank LIMIT {RARE_RESCORED}"
    )
    rows = db.execute(sql, (_or(order[:num], stats.qtf),)).fetchall()
    scored = {i: stats.score(t) for i, t in rows if i < len(allowed) and allowed[i]}
    return [i for i, _ in _top(scored)]


def timed(fn: Callable[[str], object], queries: list[str]) -> tuple[dict[str, float], list]:
    fn(queries[0])  # warm
    ms, out = [], []
    for q in queries:
        t0 = time.perf_counter()
        out.append(fn(q))
        ms.append(1000 * (time.perf_counter() - t0))
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}, out


def run(args: argparse.Namespace, tmp: Path) -> dict:
    embedder = Embedder(packaged_embedder_path())
    texts = base_texts(embedder, args.base)
    queries = [
        " ".join(t.split()[:QUERY_WORDS]) for t in query_chunks(embedder, set(texts), args.queries)
    ]
    rng = np.random.default_rng(0)
    text_of = np.concatenate(
        [np.arange(len(texts)), rng.integers(0, len(texts), args.total - len(texts))]
    )
    path = f"{tmp}/bench.db"
    upgrade_db(f"sqlite:///{path}")
    report: dict = {
        "total": args.total,
        "queries": len(queries),
        "fill_db_s": fill(path, texts, text_of),
    }
    db = sqlite3.connect(path)
    t0 = time.perf_counter()
    db.execute(f"CREATE VIRTUAL TABLE temp.vocab USING fts5vocab(main, {SQLITE_TABLE}, row)")
    db.execute("CREATE TABLE bench_df (term TEXT PRIMARY KEY, df INTEGER NOT NULL) WITHOUT ROWID")
    db.execute("INSERT INTO bench_df SELECT term, doc FROM temp.vocab")
    db.commit()
    report["df_table_build_s"] = time.perf_counter() - t0
    ids = [r[0] for r in db.execute(_TENANT_A_IDS)]
    allowed = np.zeros(args.total + 1, dtype=bool)
    allowed[ids] = True
    analyzer = Analyzer()
    terms_of = {q: index_terms(analyzer, q) for q in queries}
    engine = make_engine(f"sqlite:///{path}")
    lexical = DatabaseLexicalIndex(make_sessionmaker(engine), analyzer)
    scope = Scope(tenant="a")
    report["service"], exact = timed(lambda q: lexical.search(q, K, scope)[1].tolist(), queries)
    exact_of = dict(zip(queries, exact, strict=True))
    count_sql = f"SELECT count(*) FROM {SQLITE_TABLE} WHERE {SQLITE_TABLE} MATCH ?"
    report["match_only"], counts = timed(
        lambda q: db.execute(count_sql, (fts5_match(terms_of[q]),)).fetchone()[0], queries
    )
    bm25_sql = (
        f"SELECT rowid, bm25({SQLITE_TABLE}) AS s FROM {SQLITE_TABLE} "
        f"WHERE {SQLITE_TABLE} MATCH ? ORDER BY s LIMIT {K}"
    )
    report["bm25_no_filter"], _ = timed(
        lambda q: db.execute(bm25_sql, (fts5_match(terms_of[q]),)).fetchall(), queries
    )
    report["matches_per_query_median"] = float(np.median(counts))
    report["terms_per_query_median"] = float(np.median([len(t) for t in terms_of.values()]))
    report["maxscore"], ms_out = timed(lambda q: maxscore(db, terms_of[q]), queries)
    report["maxscore"]["equals_exact"] = sum(
        ids == exact_of[q] for q, (ids, _) in zip(queries, ms_out, strict=True)
    )
    report["maxscore"]["rows_scored_median"] = float(
        np.median([i["rows_scored"] for _, i in ms_out])
    )
    report["maxscore"]["terms_needed_share"] = float(
        np.mean([i["terms_needed"] / i["terms"] for _, i in ms_out])
    )
    for name, fn in (
        ("pruned", lambda q: pruned(db, terms_of[q])),
        ("rare_first", lambda q: rare_first(db, terms_of[q], allowed)),
    ):
        report[name], out = timed(fn, queries)
        report[name]["overlap@50"] = float(
            np.mean(
                [
                    len(set(o) & set(exact_of[q])) / max(1, len(exact_of[q]))
                    for q, o in zip(queries, out, strict=True)
                ]
            )
        )
    # the hybrid search's other serial cost, reported apart from the search (bench/hybrid_bench.py
    # measures it too, but beside a million-vector index build)
    report["query_embedding"], _ = timed(embedder.encode_query, queries)
    report["load_average_1m"] = os.getloadavg()[0]
    engine.dispose()
    db.close()
    return report


def main() -> None:
    parser = scale_parser(__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=20)
    run_in_tmp(parser.parse_args(), run, RESULTS)


if __name__ == "__main__":
    main()
