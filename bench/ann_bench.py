"""ANN at scale on real embeddings: flat vs IVF vs HNSW, and the tenant filter's cost.

    python -m bench.ann_bench [--total 1000000] [--base 20000] [--hnsw-total 200000]

Corpus: bench/ann_corpus.py (real Debian-docs chunks embedded with the packaged MiniLM; vectors
past the base are re-normalized mixes of two neighbouring real embeddings: read its docstring).
Queries: held-out chunks cut to 12 words, embedded. Ids 1..N as the database gives them; chunks
go to two tenants by document (100 chunks each, alternating), and one collection of tenant "a"
holds 1% of the corpus (the narrow-filter case).

For each index, through the service's VectorIndex: build time, memory (resident-set growth and
the serialized size), recall@10 against flat (unfiltered, tenant "a", the 1% collection) and
single-query latency p50/p95 filtered to tenant "a" (the service's case with two tenants) and
to the 1% collection (which a trained IVF index scores exactly: VectorIndex.search).
The filter is the service's cached IdBitmap; its cost is set against what search did before
(every id of the tenant loaded, then an IDSelectorBatch built). Writes
bench/results/ann_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.ann_corpus import corpus
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.faiss_internals import faiss, id_selector
from prefixrag.retrieval.id_bitmap import IdBitmap
from prefixrag.retrieval.vector_index import VectorIndex

RESULTS = Path(__file__).parent / "results" / "ann_bench.json"
K = 10
CHUNKS_PER_DOC = 100


def rss_mb() -> float:
    """This process's resident set, MB (from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scopes(num: int) -> dict[str, np.ndarray]:
    """Ids (1..num) of tenant "a" and of a 1% collection inside it."""
    ids = np.arange(1, num + 1, dtype=np.int64)
    tenant_a = ids[(ids // CHUNKS_PER_DOC) % 2 == 0]
    return {"tenant_a": tenant_a, "collection_1pct": tenant_a[: max(1, num // 100)]}


def exact_top(vectors: np.ndarray, queries: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Ground truth ids (1-based) of the K best, by blocks of numpy inner products."""
    rows = np.arange(len(vectors)) if allowed is None else allowed - 1
    best_s = np.full((len(queries), K), -np.inf, dtype=np.float32)
    best_i = np.zeros((len(queries), K), dtype=np.int64)
    for start in range(0, len(rows), 200_000):
        block = rows[start : start + 200_000]
        scores = queries @ vectors[block].T
        top = np.argpartition(-scores, K, axis=1)[:, :K]
        cand_s = np.concatenate([best_s, np.take_along_axis(scores, top, 1)], axis=1)
        cand_i = np.concatenate([best_i, block[top] + 1], axis=1)
        order = np.argsort(-cand_s, axis=1, kind="stable")[:, :K]
        best_s, best_i = np.take_along_axis(cand_s, order, 1), np.take_along_axis(cand_i, order, 1)
    return best_i


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / K for f, t in zip(found, truth, strict=True)]))


def latency(index: VectorIndex, queries: np.ndarray, allowed: IdBitmap | None) -> dict:
    index.search(queries[0], K, allowed)  # warm
    ms = []
    for q in queries:
        t0 = time.perf_counter()
        index.search(q, K, allowed)
        ms.append(1000 * (time.perf_counter() - t0))
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def build(kind: str, vectors: np.ndarray, **options: int) -> tuple[VectorIndex, dict]:
    rss0 = rss_mb()
    t0 = time.perf_counter()
    index = VectorIndex(vectors.shape[1], kind=kind, use_gpu="no", **options)
    for start in range(0, len(vectors), 100_000):  # as ingest adds: in pieces
        index.add(np.arange(start + 1, start + 1 + len(vectors[start : start + 100_000])),
                  vectors[start : start + 100_000])  # fmt: skip
    build_s = time.perf_counter() - t0
    serialized = faiss.serialize_index(index._index).nbytes
    return index, {
        "n": len(vectors),
        "build_s": round(build_s, 1),
        "rss_growth_mb": round(rss_mb() - rss0, 1),
        "serialized_mb": round(serialized / 2**20, 1),
    }


def sweep(
    index: VectorIndex,
    knob: str,
    values: list[int],
    queries: np.ndarray,
    truths: dict[str, np.ndarray],
    bitmaps: dict[str, IdBitmap | None],
    num_latency: int,
) -> list[dict]:
    points = []
    for value in values:
        setattr(index, knob, value)
        point: dict = {knob: value}
        for name, truth in truths.items():
            _, found = index.search(queries, K, bitmaps[name])
            point[f"recall@10_{name}"] = recall(found, truth)
        point["tenant_a"] = latency(index, queries[:num_latency], bitmaps["tenant_a"])
        # a small scope of a trained IVF index is scored exactly (VectorIndex.search)
        point["collection_1pct"] = latency(index, queries[:num_latency], bitmaps["collection_1pct"])
        points.append(point)
        print(knob, point, flush=True)
    return points


def filter_cost(scope_ids: np.ndarray, repeats: int = 5) -> dict:
    """Per query: the old way (ids from the database as Python ints, then an IDSelectorBatch)
    against the cached bitmap's selector. The SQL read itself is timed by the row count it
    returns at lexical_bench's measured rate, not here: this is the in-process part only."""
    as_rows = scope_ids.tolist()  # what session.scalars hands back
    t0 = time.perf_counter()
    for _ in range(repeats):
        id_selector(np.asarray(as_rows, dtype=np.int64))
    old_ms = 1000 * (time.perf_counter() - t0) / repeats
    bitmap = IdBitmap.from_ids(scope_ids)
    t0 = time.perf_counter()
    for _ in range(repeats):
        bitmap.selector()
    return {
        "ids_in_scope": len(scope_ids),
        "old_select_list_to_selector_ms": old_ms,
        "bitmap_selector_ms": 1000 * (time.perf_counter() - t0) / repeats,
        "bitmap_bytes": bitmap.num_bytes,
    }


def run(args: argparse.Namespace) -> dict:
    embedder = Embedder(packaged_embedder_path())
    data = corpus(embedder, args.total, args.base, args.queries)
    vectors, queries = data["vectors"], data["query_vectors"]
    report: dict = {
        "machine": f"{os.cpu_count()} shared CPU cores, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, faiss {faiss.__version__}",
        "corpus": {
            "total": len(vectors),
            "real_embedded_chunks": data["num_real"],
            "mixed_variants": len(vectors) - data["num_real"],
            "queries": len(queries),
            "embed_chunks_per_s": data["embed_chunks_per_s"],
        },
    }
    scope_ids = scopes(len(vectors))
    bitmaps: dict[str, IdBitmap | None] = {"all": None}
    bitmaps |= {name: IdBitmap.from_ids(ids) for name, ids in scope_ids.items()}
    t0 = time.perf_counter()
    truths = {"all": exact_top(vectors, queries, None)}
    truths |= {name: exact_top(vectors, queries, ids) for name, ids in scope_ids.items()}
    report["ground_truth_s"] = time.perf_counter() - t0
    report["filter_cost_tenant_a"] = filter_cost(scope_ids["tenant_a"])

    flat, report["flat"] = build("flat", vectors)
    report["flat"]["tenant_a"] = latency(flat, queries[: args.flat_latency], bitmaps["tenant_a"])
    print("flat", report["flat"], flush=True)
    del flat

    ivf, report["ivf"] = build("ivf", vectors, nlist=args.nlist, train_size=args.train_size)
    report["ivf"]["nlist"] = args.nlist
    report["ivf"]["points"] = sweep(
        ivf, "nprobe", args.nprobes, queries, truths, bitmaps, args.latency_queries
    )
    print("ivf", report["ivf"], flush=True)
    del ivf

    if args.hnsw_total:
        sub = vectors[: args.hnsw_total]
        sub_scopes = {name: ids[ids <= len(sub)] for name, ids in scope_ids.items()}
        sub_truths = {"all": exact_top(sub, queries, None)}
        sub_truths |= {name: exact_top(sub, queries, ids) for name, ids in sub_scopes.items()}
        sub_bitmaps: dict[str, IdBitmap | None] = {"all": None}
        sub_bitmaps |= {name: IdBitmap.from_ids(ids) for name, ids in sub_scopes.items()}
        hnsw, report["hnsw"] = build("hnsw", sub)
        report["hnsw"]["points"] = sweep(
            hnsw, "ef_search", args.efs, queries, sub_truths, sub_bitmaps, args.latency_queries
        )
        print("hnsw", report["hnsw"], flush=True)
    return report


def print_summary(report: dict) -> None:
    c = report["corpus"]
    print(f"\n{c['total']} vectors ({c['real_embedded_chunks']} real, {c['mixed_variants']} mixed)")
    fc = report["filter_cost_tenant_a"]
    print(
        f"tenant filter, {fc['ids_in_scope']} ids: old ids->selector "
        f"{fc['old_select_list_to_selector_ms']:.1f} ms/query (+ the SQL read), cached bitmap "
        f"{fc['bitmap_selector_ms']:.3f} ms ({fc['bitmap_bytes'] / 1024:.0f} KiB)"
    )
    flat = report["flat"]
    print(f"flat: build {flat['build_s']} s, {flat['serialized_mb']} MB, tenant p50 "
          f"{flat['tenant_a']['p50_ms']:.1f} p95 {flat['tenant_a']['p95_ms']:.1f} ms")  # fmt: skip
    for name, knob in (("ivf", "nprobe"), ("hnsw", "ef_search")):
        if name not in report:
            continue
        r = report[name]
        print(f"{name} (n={r['n']}): build {r['build_s']} s, {r['serialized_mb']} MB, "
              f"RSS +{r['rss_growth_mb']} MB")  # fmt: skip
        for p in r["points"]:
            print(
                f"  {knob} {p[knob]:4}: recall@10 all {p['recall@10_all']:.3f} tenant "
                f"{p['recall@10_tenant_a']:.3f} 1% {p['recall@10_collection_1pct']:.3f}; "
                f"tenant p50 {p['tenant_a']['p50_ms']:.2f} p95 {p['tenant_a']['p95_ms']:.2f} ms, "
                f"1% p50 {p['collection_1pct']['p50_ms']:.2f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", type=int, default=1_000_000)
    parser.add_argument("--base", type=int, default=20_000, help="real chunks embedded")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--train-size", type=int, default=100_000)
    parser.add_argument("--nprobes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--hnsw-total", type=int, default=200_000, help="0 skips HNSW")
    parser.add_argument("--efs", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--latency-queries", type=int, default=200)
    parser.add_argument("--flat-latency", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(args)
    report["args"] = vars(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print_summary(report)


if __name__ == "__main__":
    main()
