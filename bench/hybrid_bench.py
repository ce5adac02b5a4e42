"""Hybrid search at scale, through the service's own search path, split into its parts.

    python -m bench.hybrid_bench [--total 1000000] [--base 20000] [--nprobe 64]

A SQLite service database (the alembic schema) holds `--total` ready chunks of two tenants
(documents of 100 chunks, alternating; collection "small" of tenant "a" holds 1%), each chunk's
text and FTS5 terms its real parent chunk's (bench/ann_corpus.py: the vectors past the real base
are mixes of two real embeddings; their text repeats the parent's). The vector index is the
service's kind "auto" past its threshold: IVF, nlist 1024, `--nprobe`.

Measured for tenant "a" with the 500 held-out queries (first `--queries` of them):
- the allowed ids: what search did before (every id of the tenant read from SQL, then an
  IDSelectorBatch) against the cached bitmap (first read, then cached);
- embed (query), vector (FAISS, filtered), lexical (FTS5 bm25(), filtered in SQL), and the whole
  app.services.search.search call (embed + both + fusion + loading the hit rows; no reranker);
- the same lexical search and whole call with settings.lexical_engine "tantivy" (its index built
  from the same terms; build time and size reported), and how many of its top K the database
  store's top K holds. Every copy of a base text has that text's score, so the top K is mostly
  ties, and which of the tied copies each side keeps is arbitrary: the overlap is reported
  both by chunk id and by base text.
Writes bench/results/hybrid_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from pathlib import Path

import numpy as np
from sqlalchemy import select
from tqdm import tqdm

from bench.ann_corpus import corpus
from bench.scale_cli import run_in_tmp, scale_parser
from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.lexical import SQLITE_TABLE
from prefixrag.app.core.models import Chunk, Collection, Document
from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.services.lexical import DatabaseLexicalIndex, TantivyLexicalIndex
from prefixrag.app.services.scopes import Scope, ScopeCache
from prefixrag.app.services.search import search
from prefixrag.app.startup import index_options
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.faiss_internals import id_selector
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from prefixrag.retrieval.lexical.terms import index_terms
from prefixrag.retrieval.pipeline import Retriever
from prefixrag.retrieval.vector_index import VectorIndex

RESULTS = Path(__file__).parent / "results" / "hybrid_bench.json"
CHUNKS_PER_DOC = 100
K = 50  # candidates per side, the service default


def collection_of(doc_id: int, first: int, num: int) -> int:
    """Tenant by document (collection 1 or 3: tenant a; 2: tenant b); the first 1% of tenant
    a's documents are in collection 3, "small"."""
    collection = 1 if doc_id % 2 == 1 else 2
    return 3 if collection == 1 and first < num // 50 else collection


def analyzed(texts: list[str]) -> list[str]:
    """Each text's terms as the service stores them (space-joined), each text analyzed once."""
    analyzer = Analyzer()
    return [" ".join(index_terms(analyzer, t)) for t in tqdm(texts, desc="analyze")]


def fill(
    db_path: str, texts: list[str], text_of: np.ndarray, terms: list[str] | None = None
) -> float:
    """Write collections, documents, chunks and FTS5 terms with plain SQL; returns seconds.
    `terms`: `analyzed(texts)` when the caller has it already."""
    terms = terms if terms is not None else analyzed(texts)
    t0 = time.perf_counter()
    db = sqlite3.connect(db_path)
    now = "2026-01-01 00:00:00"
    db.executemany(
        "INSERT INTO collections (id, tenant, name, created_at) VALUES (?, ?, ?, ?)",
        [(1, "a", "main", now), (2, "b", "main", now), (3, "a", "small", now)],
    )
    num = len(text_of)
    for doc_start in range(0, num, CHUNKS_PER_DOC * 100):
        docs, chunks, fts = [], [], []
        for first in range(doc_start, min(num, doc_start + CHUNKS_PER_DOC * 100), CHUNKS_PER_DOC):
            doc_id = first // CHUNKS_PER_DOC + 1  # ids 1..N
            collection = collection_of(doc_id, first, num)
            docs.append((doc_id, collection, f"d{doc_id}", "text/plain", 1, f"{doc_id:064d}",
                         "ready", "{}", now, now))  # fmt: skip
            for row in range(first, min(num, first + CHUNKS_PER_DOC)):
                body = texts[text_of[row]]
                chunks.append((row + 1, doc_id, row - first, body, 0, len(body), 128))
                fts.append((row + 1, terms[text_of[row]]))
        db.executemany(
            "INSERT INTO documents (id, collection_id, title, media_type, num_bytes, sha256, "
            "status, metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            docs,
        )
        db.executemany(
            "INSERT INTO chunks (id, document_id, ordinal, text, char_start, char_end, "
            "num_tokens) VALUES (?, ?, ?, ?, ?, ?, ?)",
            chunks,
        )
        db.executemany(f"INSERT INTO {SQLITE_TABLE} (rowid, terms) VALUES (?, ?)", fts)
        db.commit()
    db.execute("ANALYZE")
    db.close()
    return time.perf_counter() - t0


def build_tantivy(path: Path, terms: list[str], text_of: np.ndarray) -> float:
    """The tantivy index of the same chunks (what the service's start-up builds from the rows),
    100,000 chunks per commit; returns seconds."""
    t0 = time.perf_counter()
    store = TantivyLexical(path)
    split = [t.split() for t in terms]
    num = len(text_of)
    for start in range(0, num, 100_000):
        rows = range(start, min(num, start + 100_000))
        doc_ids = [row // CHUNKS_PER_DOC + 1 for row in rows]
        store.add(
            [row + 1 for row in rows],
            [split[text_of[row]] for row in rows],
            document_ids=doc_ids,
            collection_ids=[collection_of(d, (d - 1) * CHUNKS_PER_DOC, num) for d in doc_ids],
        )
    store.close()
    return time.perf_counter() - t0


def overlap(a: np.ndarray, b: np.ndarray, text_of: np.ndarray) -> tuple[float, float]:
    """Shares of `a` in `b`: by chunk id, and by base text (ids are 1-based rows)."""
    by_id = len(set(a.tolist()) & set(b.tolist())) / max(len(a), 1)
    texts_a, texts_b = set(text_of[a - 1].tolist()), set(text_of[b - 1].tolist())
    return by_id, len(texts_a & texts_b) / max(len(texts_a), 1)


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def percentiles(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def timed(fn, repeats: list) -> dict[str, float]:  # type: ignore[no-untyped-def]
    fn(repeats[0])  # warm
    ms = []
    for item in repeats:
        t0 = time.perf_counter()
        fn(item)
        ms.append(1000 * (time.perf_counter() - t0))
    return percentiles(ms)


def old_allowed_ids(sessions, tenant: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    """What search did per query before the scope cache: every id of the tenant, then a
    selector built from them."""
    query = select(Chunk.id).join(Document).join(Collection).where(Document.status == "ready")
    with sessions() as session:
        ids = np.asarray(list(session.scalars(query.where(Collection.tenant == tenant))))
    id_selector(ids)
    return ids


def run(args: argparse.Namespace, tmp: Path) -> dict:
    embedder = Embedder(packaged_embedder_path())
    data = corpus(embedder, args.total, args.base, 500)
    vectors = data["vectors"]
    queries = data["queries"][: args.queries]
    url = f"sqlite:///{tmp}/bench.db"
    upgrade_db(url)
    report: dict = {"total": len(vectors), "real": data["num_real"], "queries": len(queries)}
    terms = analyzed(data["texts"])
    report["fill_db_s"] = fill(f"{tmp}/bench.db", data["texts"], data["text_of"], terms)
    print("filled", report["fill_db_s"], flush=True)
    report["tantivy_build_s"] = build_tantivy(tmp / "lexical", terms, data["text_of"])
    report["tantivy_mb"] = dir_mb(tmp / "lexical")
    print("tantivy", report["tantivy_build_s"], flush=True)
    settings = Settings(index_nprobe=args.nprobe)
    t0 = time.perf_counter()
    index = VectorIndex(vectors.shape[1], **index_options(settings) | {"use_gpu": "no"})
    for start in range(0, len(vectors), 100_000):
        block = vectors[start : start + 100_000]
        index.add(np.arange(start + 1, start + 1 + len(block)), block)
    report["index_build_s"] = time.perf_counter() - t0
    report["index"] = {"trained_ivf": index.is_trained_ivf, "nlist": index.nlist,
                       "nprobe": index.nprobe}  # fmt: skip
    print("index", report["index_build_s"], flush=True)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    lexical = DatabaseLexicalIndex(sessions)
    retriever = Retriever(embedder, index, None, lexical=lexical)
    scopes = ScopeCache()
    few = list(range(5))
    report["allowed_ids_before"] = timed(lambda _: old_allowed_ids(sessions, "a"), few)
    with sessions() as session:
        t0 = time.perf_counter()
        allowed = scopes.allowed(session, tenant="a", collection=None)
        report["bitmap_first_read_ms"] = 1000 * (time.perf_counter() - t0)
        report["bitmap_cached"] = timed(
            lambda _: scopes.allowed(session, tenant="a", collection=None), few
        )
    qvecs = {q: embedder.encode_query(q) for q in queries}
    report["embed"] = timed(embedder.encode_query, queries)
    report["vector"] = timed(lambda q: index.search(qvecs[q], K, allowed), queries)
    report["lexical"] = timed(lambda q: lexical.search(q, K, Scope(tenant="a")), queries)

    def whole(q: str) -> None:
        with sessions() as session:
            search(session=session, retriever=retriever, scopes=scopes, query=q, top_k=5,
                   candidates=K, scope=Scope(tenant="a"))  # fmt: skip

    report["hybrid_search"] = timed(whole, queries)

    side = TantivyLexicalIndex(sessions, TantivyLexical(tmp / "lexical"), Analyzer())
    report["lexical_tantivy"] = timed(lambda q: side.search(q, K, Scope(tenant="a")), queries)
    shares = [
        overlap(
            side.search(q, K, Scope(tenant="a"))[1],
            lexical.search(q, K, Scope(tenant="a"))[1],
            data["text_of"],
        )
        for q in queries
    ]
    report["tantivy_overlap_at_k"] = {
        "k": K,
        "by_chunk_id": float(np.mean([s[0] for s in shares])),
        "by_base_text": float(np.mean([s[1] for s in shares])),
    }
    retriever = Retriever(embedder, index, None, lexical=side)
    report["hybrid_search_tantivy"] = timed(whole, queries)
    report["rss_mb"] = rss_mb()
    report["db_mb"] = os.path.getsize(f"{tmp}/bench.db") / 2**20
    engine.dispose()
    return report


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = scale_parser(__doc__.splitlines()[0])
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--queries", type=int, default=100)
    run_in_tmp(parser.parse_args(), run, RESULTS)


if __name__ == "__main__":
    main()
