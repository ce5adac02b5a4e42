"""Retrieval speed: ingest throughput, search latency, and flat vs IVF on random vectors.

    python -m bench.retrieval_bench [--ivf-n 200000] [--collection 10000]

1. Ingest: parse + chunk + embed + index add over Python docs pages (python3.11-doc), against a
   bare SentenceTransformer.encode of the same chunk texts in the same run.
2. Latency over a `--collection`-chunk index: first stage (embed query + FAISS) alone, and with
   50 candidates reranked by a locally built cross-encoder of MiniLM-L6 shape (random weights:
   no pretrained cross-encoder exists on this machine, and timing doesn't depend on the weights).
3. Flat vs IVF (nlist, several nprobe) on random unit 384-d vectors: recall@10 against flat and
   ms per single query.
Writes bench/results/retrieval_bench.json and .png and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.chunking import Chunker
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.parsing import parse_document
from prefixrag.retrieval.pipeline import Retriever, TextPassage
from prefixrag.retrieval.reranker import Reranker
from prefixrag.retrieval.vector_index import VectorIndex

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
INGEST_DOCS = [
    "tutorial/controlflow.html", "tutorial/datastructures.html", "tutorial/classes.html",
    "tutorial/errors.html", "tutorial/modules.html", "library/functions.html",
    "library/json.html",
]  # fmt: skip
QUERIES = [
    "how do I make a queue", "read a file line by line", "default argument evaluated once",
    "named tuple fields", "regular expression groups", "list files in a directory",
    "serialize to json", "configure logging to a file", "class inheritance order",
    "catch several exceptions", "sort a list by key", "iterate two lists together",
]  # fmt: skip
RESULTS = Path(__file__).parent / "results"


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(samples_ms, 50)),
        "p95_ms": float(np.percentile(samples_ms, 95)),
    }


def bench_ingest(embedder: Embedder) -> tuple[dict, list[str], np.ndarray]:
    """Pipeline ingest vs bare encode; also returns the chunk texts and their vectors."""
    raw = [(DOC_ROOT / name).read_bytes() for name in INGEST_DOCS]
    chunker = Chunker(embedder.count_tokens, 200, 32)
    index = VectorIndex(embedder.dim, use_gpu="no")
    t0 = time.perf_counter()
    texts: list[str] = []
    vectors = []
    for data in tqdm(raw, desc="ingest (pipeline)"):
        chunks = chunker.split(parse_document(data, "text/html"))
        doc_texts = [c.text for c in chunks]
        doc_vectors = embedder.encode(doc_texts)
        index.add(np.arange(len(texts), len(texts) + len(doc_texts)), doc_vectors)
        texts.extend(doc_texts)
        vectors.append(doc_vectors)
    pipeline_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    embedder.model.encode(texts, batch_size=embedder.batch_size, show_progress_bar=True)
    encode_s = time.perf_counter() - t0
    num_mb = sum(len(t) for t in texts) / 1e6
    return (
        {
            "documents": len(raw),
            "chunks": len(texts),
            "text_mb": round(num_mb, 3),
            "pipeline_s": round(pipeline_s, 2),
            "bare_encode_s": round(encode_s, 2),
            "pipeline_chunks_per_s": len(texts) / pipeline_s,
            "bare_encode_chunks_per_s": len(texts) / encode_s,
            "pipeline_mb_text_per_min": num_mb / pipeline_s * 60,
            "pipeline_vs_bare_encode": encode_s / pipeline_s,
        },
        texts,
        np.vstack(vectors),
    )


def build_cross_encoder(embedder_path: str, out_dir: Path) -> Path:
    """A MiniLM-L6-shaped BERT cross-encoder with random weights, saved for CrossEncoder."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(embedder_path)
    config.num_labels = 1
    BertForSequenceClassification(config).eval().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(embedder_path).save_pretrained(out_dir)
    return out_dir


def bench_latency(
    embedder: Embedder, texts: list[str], vectors: np.ndarray, size: int, rerank_queries: int
) -> dict:
    # NOTE: the real chunks are padded to `size` with jittered copies of their vectors, so the
    # collection has the density of real embeddings without embedding `size` chunks here
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(vectors), size)
    padded = vectors[picks] + rng.normal(0, 0.02, (size, vectors.shape[1])).astype(np.float32)
    padded /= np.linalg.norm(padded, axis=1, keepdims=True)
    index = VectorIndex(embedder.dim, use_gpu="no")
    index.add(np.arange(size), padded)
    fetch = lambda ids: {i: TextPassage(texts[picks[i]]) for i in ids}  # noqa: E731
    result: dict = {"collection": size}
    first = Retriever(embedder, index, None)
    samples = []
    for q in tqdm(QUERIES * 10, desc="first stage"):
        t0 = time.perf_counter()
        first.retrieve(q, top_k=5, candidates=50, allowed_ids=None, load_passages=fetch)
        samples.append(1000 * (time.perf_counter() - t0))
    result["first_stage"] = percentiles(samples)
    with tempfile.TemporaryDirectory() as tmp:
        reranker = Reranker(str(build_cross_encoder(packaged_embedder_path(), Path(tmp))))
        if not reranker.is_available:
            raise RuntimeError(f"bench cross-encoder failed to load: {reranker.status}")
        second = Retriever(embedder, index, reranker)
        second.retrieve(QUERIES[0], top_k=5, candidates=50, allowed_ids=None, load_passages=fetch)
        stages = []
        for q in tqdm((QUERIES * 10)[:rerank_queries], desc="rerank 50"):
            t0 = time.perf_counter()
            r = second.retrieve(q, top_k=5, candidates=50, allowed_ids=None, load_passages=fetch)
            stages.append((1000 * (time.perf_counter() - t0), r.timings["rerank_ms"]))
    result["rerank_50"] = percentiles([s[0] for s in stages])
    result["rerank_50"]["rerank_stage_p50_ms"] = float(np.percentile([s[1] for s in stages], 50))
    result["rerank_model"] = "random-weight BERT with all-MiniLM-L6 shape (6 layers, 384 hidden)"
    return result


def bench_ivf(n: int, nlist: int, num_queries: int, nprobes: list[int]) -> dict:
    rng = np.random.default_rng(1)
    dim = 384
    base = rng.standard_normal((n, dim), dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = rng.standard_normal((num_queries, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = np.arange(n)
    flat = VectorIndex(dim, kind="flat", use_gpu="no")
    flat.add(ids, base)
    flat_ms, (_, truth) = _per_query(flat, queries)
    t0 = time.perf_counter()
    ivf = VectorIndex(dim, kind="ivf", nlist=nlist, use_gpu="no", train_size=min(n, 39 * nlist))
    ivf.add(ids, base)
    build_s = time.perf_counter() - t0
    if not ivf.is_trained_ivf:
        raise RuntimeError("IVF did not train; raise --ivf-n or lower --nlist")
    points = []
    for nprobe in nprobes:
        ivf.nprobe = nprobe
        ms, (_, found) = _per_query(ivf, queries)
        recall = np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])
        points.append({"nprobe": nprobe, "recall@10": float(recall), "ms_per_query": ms})
    return {
        "n": n,
        "dim": dim,
        "nlist": nlist,
        "queries": num_queries,
        "flat_ms_per_query": flat_ms,
        "ivf_build_s": build_s,
        "ivf": points,
    }


def _per_query(index: VectorIndex, queries: np.ndarray) -> tuple[float, tuple]:
    """Mean ms of one-query searches (as the ask path does), and the batched results."""
    t0 = time.perf_counter()
    for q in queries:
        index.search(q, 10)
    ms = 1000 * (time.perf_counter() - t0) / len(queries)
    return ms, index.search(queries, 10)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lat = report["latency"]
    names = ["first stage", "+ rerank 50"]
    for offset, key in ((-0.2, "p50_ms"), (0.2, "p95_ms")):
        values = [lat["first_stage"][key], lat["rerank_50"][key]]
        left.bar(np.arange(2) + offset, values, width=0.4, label=key.replace("_ms", ""))
    left.set_xticks(range(2), names)
    left.set_yscale("log")
    left.set_ylabel("ms per query")
    left.set_title(f"search latency, {lat['collection']} chunks (CPU)")
    left.legend()
    ivf = report["ivf"]
    right.plot([p["ms_per_query"] for p in ivf["ivf"]], [p["recall@10"] for p in ivf["ivf"]], "o-")
    for p in ivf["ivf"]:
        right.annotate(f"nprobe={p['nprobe']}", (p["ms_per_query"], p["recall@10"]))
    right.axvline(ivf["flat_ms_per_query"], color="gray", linestyle="--", label="flat (exact)")
    right.set_xlabel("ms per query")
    right.set_ylabel("recall@10 vs flat")
    right.set_title(f"IVF{ivf['nlist']} on {ivf['n']} random {ivf['dim']}-d vectors")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ivf-n", type=int, default=100_000, help="vectors for flat vs IVF")
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--nprobes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--ivf-queries", type=int, default=100)
    parser.add_argument("--collection", type=int, default=10_000)
    parser.add_argument("--rerank-queries", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    embedder = Embedder(packaged_embedder_path())
    ingest, texts, vectors = bench_ingest(embedder)
    report = {
        "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
        "ingest": ingest,
        "latency": bench_latency(embedder, texts, vectors, args.collection, args.rerank_queries),
        "ivf": bench_ivf(args.ivf_n, args.nlist, args.ivf_queries, args.nprobes),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "retrieval_bench.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "retrieval_bench.png")
    print_summary(report)


def print_summary(report: dict) -> None:
    i, lat, ivf = report["ingest"], report["latency"], report["ivf"]
    print(
        f"\ningest: {i['chunks']} chunks, {i['text_mb']} MB: pipeline "
        f"{i['pipeline_chunks_per_s']:.1f} chunks/s ({i['pipeline_mb_text_per_min']:.2f} MB/min) "
        f"vs bare encode {i['bare_encode_chunks_per_s']:.1f} chunks/s "
        f"-> {100 * i['pipeline_vs_bare_encode']:.0f}%"
    )
    fs, rr = lat["first_stage"], lat["rerank_50"]
    print(
        f"latency over {lat['collection']} chunks: first stage p50 {fs['p50_ms']:.1f} ms "
        f"p95 {fs['p95_ms']:.1f} ms; +rerank 50 p50 {rr['p50_ms']:.0f} ms p95 {rr['p95_ms']:.0f} ms"
    )
    flat_ms = ivf["flat_ms_per_query"]
    print(f"flat vs IVF{ivf['nlist']} on {ivf['n']} x {ivf['dim']}: flat {flat_ms:.2f} ms/q")
    for p in ivf["ivf"]:
        recall, ms = p["recall@10"], p["ms_per_query"]
        print(f"  nprobe {p['nprobe']:4}: recall@10 {recall:.3f}, {ms:.2f} ms/q")


if __name__ == "__main__":
    main()
