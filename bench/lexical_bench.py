"""BM25 inside the database at size: write cost and query latency of the service's lexical store
(app/services/lexical.py) on SQLite FTS5 and, given a URL, PostgreSQL (tsvector + GIN).

The corpus is real text, the Python 3.11 docs under /usr/share/doc/python3.11/html, cut into
~120-word chunks and repeated (each repeat in a new document) up to --chunks, split evenly over
two tenants. Queries are the eval's questions (bench/data/python_docs_qa.json), searched for one
tenant (the service's filtered case) and unfiltered.

    python -m bench.lexical_bench [--chunks 100000] [--postgres-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.lexical import insert_chunk_terms
from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.app.services.scopes import Scope
from prefixrag.retrieval.html_text import html_to_text
from prefixrag.retrieval.lexical.analyzer import Analyzer

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
QUESTIONS = Path(__file__).parent / "data" / "python_docs_qa.json"
RESULTS = Path(__file__).parent / "results" / "lexical_bench.json"
WORDS_PER_CHUNK = 120
CHUNKS_PER_DOC = 100
K = 50


def doc_chunks(limit_files: int = 400) -> list[str]:
    """~120-word windows of the Python docs' library pages."""
    out: list[str] = []
    for path in sorted((DOC_ROOT / "library").glob("*.html"))[:limit_files]:
        words = html_to_text(path.read_bytes())[0].split()
        out += [
            " ".join(words[i : i + WORDS_PER_CHUNK]) for i in range(0, len(words), WORDS_PER_CHUNK)
        ]
    return out


def fill(sessions: sessionmaker[Session], base: list[str], num_chunks: int) -> float:
    """Write num_chunks chunks with their terms as ingest does; returns seconds spent on terms."""
    analyzer, terms_s, written, n = Analyzer(), 0.0, 0, 0
    with sessions() as session:
        tenants = [Collection(tenant=t, name="c") for t in ("a", "b")]
        session.add_all(tenants)
        session.flush()
        while written < num_chunks:
            doc = Document(
                collection_id=tenants[n % 2].id,
                title=f"d{n}",
                filename=None,
                media_type="text/plain",
                num_bytes=1,
                sha256=f"{n:064d}",
                status="ready",
                meta={},
            )
            session.add(doc)
            session.flush()
            texts = [
                f"{base[(written + i) % len(base)]} v{n}"  # the repeat number varies the text
                for i in range(min(CHUNKS_PER_DOC, num_chunks - written))
            ]
            rows = [
                Chunk(
                    document_id=doc.id,
                    ordinal=i,
                    text=t,
                    char_start=0,
                    char_end=len(t),
                    num_tokens=WORDS_PER_CHUNK,
                )
                for i, t in enumerate(texts)
            ]
            session.add_all(rows)
            session.flush()
            t0 = time.perf_counter()
            insert_chunk_terms(session, analyzer, [r.id for r in rows], texts)
            terms_s += time.perf_counter() - t0
            written, n = written + len(texts), n + 1
            if n % 50 == 0:
                session.commit()
        session.commit()
    return terms_s


def latencies(lexical: DatabaseLexicalIndex, queries: list[str], scope: Scope) -> dict:
    lexical.search(queries[0], K, scope)  # warm the caches once
    ms = []
    for q in queries:
        t0 = time.perf_counter()
        lexical.search(q, K, scope)
        ms.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def run(url: str, base: list[str], num_chunks: int, queries: list[str]) -> dict:
    upgrade_db(url)
    engine = make_engine(url)
    try:
        sessions = make_sessionmaker(engine)
        t0 = time.perf_counter()
        terms_s = fill(sessions, base, num_chunks)
        fill_s = time.perf_counter() - t0
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn:
                conn.execute(text("ANALYZE"))
        t0 = time.perf_counter()
        lexical = DatabaseLexicalIndex(sessions)  # what start-up does: nothing is built
        start_s = time.perf_counter() - t0
        return {
            "chunks": num_chunks,
            "write_all_rows_s": round(fill_s, 1),
            "of_which_terms_s": round(terms_s, 1),
            "start_lexical_s": start_s,
            "one_tenant": latencies(lexical, queries, Scope(tenant="a")),
            "unfiltered": latencies(lexical, queries, Scope()),
        }
    finally:
        engine.dispose()


def postgres_schema_url(base: str) -> tuple[str, str]:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with create_engine(base, isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False), schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--postgres-url", default=None)
    args = parser.parse_args()
    base = doc_chunks()
    queries = [q["q"] for q in json.loads(QUESTIONS.read_text())["questions"]]
    report: dict = {"distinct_base_chunks": len(base), "k": K, "queries": len(queries)}
    with tempfile.TemporaryDirectory() as tmp:
        report["sqlite"] = run(f"sqlite:///{tmp}/bench.db", base, args.chunks, queries)
        print("sqlite", report["sqlite"], flush=True)
    if args.postgres_url:
        url, schema = postgres_schema_url(args.postgres_url)
        try:
            report["postgresql"] = run(url, base, args.chunks, queries)
            print("postgresql", report["postgresql"], flush=True)
        finally:
            with create_engine(args.postgres_url, isolation_level="AUTOCOMMIT").connect() as c:
                c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
