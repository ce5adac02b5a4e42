"""Retrieval quality on the Python 3.11 docs: recall@1/5/10 and MRR per retrieval variant.

Needs Debian's python3.11-doc (HTML under /usr/share/doc/python3.11/html). The questions in
bench/data/python_docs_qa.json are paraphrases; a chunk is relevant when it contains one of the
question's answer strings verbatim.

    python -m bench.retrieval_eval [--chunk-tokens 200] [--overlap 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from app.settings import Settings, packaged_embedder_path
from retrieval.chunking import Chunk, Chunker
from retrieval.embedder import Embedder
from retrieval.fusion import bm25_tokens, ranks_of, rrf
from retrieval.parsing import parse_document
from retrieval.pipeline import Retriever
from retrieval.reranker import Reranker
from retrieval.vector_index import VectorIndex

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
DATA = Path(__file__).parent / "data" / "python_docs_qa.json"
RESULTS = Path(__file__).parent / "results" / "retrieval_eval.json"
KS = (1, 5, 10)
CANDIDATES = 50


def load_chunks(spec: dict, chunker: Chunker) -> list[tuple[str, Chunk]]:
    """(document name, chunk) for every chunk of every document of the eval set."""
    out: list[tuple[str, Chunk]] = []
    for name in tqdm(spec["documents"], desc="parse+chunk"):
        doc = parse_document((DOC_ROOT / name).read_bytes(), "text/html")
        out.extend((name, chunk) for chunk in chunker.split(doc))
    return out


def first_relevant_rank(ranked_ids: list[int], texts: list[str], answers: list[str]) -> int | None:
    for rank, chunk_id in enumerate(ranked_ids):
        if any(a in texts[chunk_id] for a in answers):
            return rank
    return None


def metrics(ranks: list[int | None]) -> dict[str, float]:
    out = {f"recall@{k}": float(np.mean([r is not None and r < k for r in ranks])) for k in KS}
    out["mrr@10"] = float(
        np.mean([1.0 / (r + 1) if r is not None and r < 10 else 0.0 for r in ranks])
    )
    return out


def evaluate(
    name: str, questions: list[dict], texts: list[str], rank_fn: Callable[[str], list[int]]
) -> dict:
    ranks = []
    start = time.perf_counter()
    for q in tqdm(questions, desc=name):
        ranks.append(first_relevant_rank(rank_fn(q["q"])[:10], texts, q["a"]))
    result = metrics(ranks) | {
        "ms_per_query": 1000 * (time.perf_counter() - start) / len(questions)
    }
    result["misses_at_5"] = [
        q["q"] for q, r in zip(questions, ranks, strict=True) if r is None or r >= 5
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-tokens", type=int, default=200)
    parser.add_argument("--overlap", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(DATA.read_text())
    questions = spec["questions"]

    embedder = Embedder(packaged_embedder_path())
    chunker = Chunker(embedder.count_tokens, args.chunk_tokens, args.overlap)
    t0 = time.perf_counter()
    chunks = load_chunks(spec, chunker)
    texts = [c.text for _, c in chunks]
    num_mb = sum(len(t) for t in texts) / 1e6
    answerable = sum(any(a in t for t in texts for a in q["a"]) for q in questions)

    ids = np.arange(len(texts), dtype=np.int64)
    index = VectorIndex(embedder.dim, use_gpu="no")
    index.add(ids, embedder.encode(texts, show_progress=True))
    with_heading = [f"{c.heading}\n{c.text}" if c.heading else c.text for _, c in chunks]
    heading_index = VectorIndex(embedder.dim, use_gpu="no")
    heading_index.add(ids, embedder.encode(with_heading, show_progress=True))
    ingest_s = time.perf_counter() - t0

    fetch = lambda chunk_ids: {i: texts[i] for i in chunk_ids}  # noqa: E731
    reranker = Reranker(Settings().rerank_model)
    dense = Retriever(embedder, index, None)
    hybrid_candidates = Retriever(embedder, index, None, hybrid=True)
    dense_heading = Retriever(embedder, heading_index, None)
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi([bm25_tokens(t) or [""] for t in texts])

    def retriever_fn(retriever: Retriever) -> Callable[[str], list[int]]:
        def rank(query: str) -> list[int]:
            result = retriever.retrieve(
                query, top_k=10, candidates=CANDIDATES, allowed_ids=None, fetch_texts=fetch
            )
            return [h.chunk_id for h in result.hits]

        return rank

    def bm25_rank(query: str) -> list[int]:
        return np.argsort(-bm25.get_scores(bm25_tokens(query)), kind="stable")[:CANDIDATES].tolist()

    def hybrid_full(query: str) -> list[int]:
        """RRF over the union of dense and BM25 top candidates of the whole corpus."""
        _, dense_ids = index.search(embedder.encode_query(query), CANDIDATES)
        dense_rank = {c: r for r, c in enumerate(dense_ids[0].tolist())}
        lexical_rank = ranks_of(bm25.get_scores(bm25_tokens(query)))
        pool = list(dict.fromkeys(dense_ids[0].tolist() + bm25_rank(query)))
        fused = rrf(
            np.array([dense_rank.get(c, len(texts)) for c in pool]),
            np.array([lexical_rank[c] for c in pool]),
        )
        return [pool[i] for i in np.argsort(-fused, kind="stable")]

    variants = {
        "dense": retriever_fn(dense),
        "dense_heading_prefix": retriever_fn(dense_heading),
        "bm25": bm25_rank,
        "hybrid_bm25_rerank_of_dense_candidates": retriever_fn(hybrid_candidates),
        "hybrid_rrf_full_corpus": hybrid_full,
    }
    results = {name: evaluate(name, questions, texts, fn) for name, fn in variants.items()}
    if reranker.is_available:
        results["dense+cross_encoder"] = evaluate(
            "rerank", questions, texts, retriever_fn(Retriever(embedder, index, reranker))
        )
    report = {
        "corpus": {
            "documents": len(spec["documents"]),
            "chunks": len(texts),
            "text_mb": round(num_mb, 3),
            "chunk_tokens": args.chunk_tokens,
            "overlap_tokens": args.overlap,
            "ingest_seconds_both_indexes": round(ingest_s, 1),
        },
        "questions": len(questions),
        "answerable_in_some_chunk": answerable,
        "candidates": CANDIDATES,
        "reranker": {"model": Settings().rerank_model, "status": reranker.status},
        "results": results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print_summary(report)


def print_summary(report: dict) -> None:
    c = report["corpus"]
    print(
        f"\n{c['documents']} docs, {c['chunks']} chunks, {c['text_mb']} MB text; "
        f"{report['questions']} questions ({report['answerable_in_some_chunk']} answerable)"
    )
    print(f"reranker {report['reranker']['model']}: {report['reranker']['status']}")
    print(f"{'variant':42} {'R@1':>6} {'R@5':>6} {'R@10':>6} {'MRR':>6} {'ms/q':>7}")
    for name, r in report["results"].items():
        print(
            f"{name:42} {r['recall@1']:6.3f} {r['recall@5']:6.3f} {r['recall@10']:6.3f} "
            f"{r['mrr@10']:6.3f} {r['ms_per_query']:7.1f}"
        )


if __name__ == "__main__":
    main()
