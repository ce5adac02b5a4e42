"""Start-up to ready at scale: `prefixrag serve` from process start to /readyz 200, over a data
dir whose database and vector index are consistent (nothing to repair).

    python -m bench.startup_bench [--total 1000000] [--runs 3] [--tmp DIR]

The data dir holds `--total` ready chunks of two tenants (bench/hybrid_bench.py's fill: the real
Debian chunk texts of bench/ann_corpus.py, repeated, with their FTS5 terms), the service's own
index kind ("auto": IVF past its threshold) saved where the service opens it, and the tantivy
BM25 index of the same chunks (timed again with PREFIXRAG_LEXICAL_ENGINE=tantivy). The vectors
are seeded random unit vectors: start-up reads them and never looks at their values (IVF is
trained when the bench builds the index, not at start), so real embeddings would time the same.

The server runs without the LLM (PREFIXRAG_LOAD_LLM=false: its load does not grow with the
corpus) and without a GPU index. Each run is a fresh process on the same files (the first run
may read them from disk; later ones find them in the page cache). The same server over an empty
data dir gives the floor no corpus work can lower (mostly importing sentence-transformers, also
timed alone); the start-up steps that touch the corpus are timed in this process, one by one.

Writes bench/results/startup_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.ann_corpus import base_texts
from bench.hybrid_bench import analyzed, build_tantivy, fill
from bench.load_server import ServerProcess, wait_ready
from bench.scale_cli import run_in_tmp, scale_parser
from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.services.index_sync import ready_chunk_ids, reconcile_index
from prefixrag.app.startup import index_options
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.vector_index import VectorIndex

RESULTS = Path(__file__).parent / "results" / "startup_bench.json"
GOAL_S = 10.0
READY_TIMEOUT_S = 600.0


def build(settings: Settings, embedder: Embedder, total: int, num_base: int) -> dict[str, float]:
    """The database and the saved index of `total` chunks; seconds each took."""
    texts = base_texts(embedder, num_base)
    rng = np.random.default_rng(0)
    text_of = np.concatenate(
        [np.arange(min(total, len(texts))), rng.integers(0, len(texts), max(0, total - len(texts)))]
    )
    url = settings.resolved_database_url
    settings.index_dir.mkdir(parents=True, exist_ok=True)
    upgrade_db(url)
    terms = analyzed(texts)
    out = {"fill_db_s": fill(url.removeprefix("sqlite:///"), texts, text_of, terms)}
    # the tantivy BM25 index of the same rows, for the runs with lexical_engine "tantivy"
    out["tantivy_build_s"] = build_tantivy(settings.lexical_index_dir, terms, text_of)
    t0 = time.perf_counter()
    index = VectorIndex(embedder.dim, path=settings.index_path, **index_options(settings))
    for start in range(0, total, 100_000):
        block = rng.standard_normal((min(100_000, total - start), embedder.dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        index.add(np.arange(start + 1, start + 1 + len(block)), block)
    index.save()
    out["index_build_s"] = time.perf_counter() - t0
    out["index_file_mb"] = settings.index_path.stat().st_size / 2**20
    out["db_file_mb"] = Path(url.removeprefix("sqlite:///")).stat().st_size / 2**20
    return out


def serve_to_ready(data_dir: Path, log_path: Path, lexical_engine: str = "database") -> float:
    """Seconds from launching `prefixrag serve` to its first /readyz 200."""
    env = {"PREFIXRAG_LOAD_LLM": "false", "PREFIXRAG_INDEX_USE_GPU": "no", "OMP_NUM_THREADS": "1"}
    env["PREFIXRAG_LEXICAL_ENGINE"] = lexical_engine
    server = ServerProcess(data_dir, log_path, env)
    t0 = time.perf_counter()
    server.start()
    try:
        wait_ready(server.url, READY_TIMEOUT_S, {}, server)
        return time.perf_counter() - t0
    finally:
        server.stop()


def import_seconds(module: str) -> float:
    """Wall seconds a fresh interpreter takes to import `module` (start-up pays it once)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - t0


def parts(settings: Settings) -> dict[str, float]:
    """The corpus-sized start-up steps, timed one by one in this process (seconds)."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    upgrade_db(settings.resolved_database_url)
    out["migrate_check_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    embedder = Embedder(packaged_embedder_path())
    out["embedder_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = VectorIndex.open(settings.index_path, embedder.dim, **index_options(settings))
    out["index_open_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.ids()
    out["index_ids_s"] = time.perf_counter() - t0
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    t0 = time.perf_counter()
    with sessions() as session:
        ready_chunk_ids(session=session)
    out["db_ready_ids_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = reconcile_index(sessions=sessions, index=index, embedder=embedder)
    out["reconcile_s"] = time.perf_counter() - t0
    if not report.is_consistent:
        raise RuntimeError(f"the stores were not consistent: {report}")
    engine.dispose()
    return out


def run(args: argparse.Namespace, tmp: Path) -> dict:
    data_dir = tmp / "data"
    settings = Settings(data_dir=data_dir, index_use_gpu="no")
    embedder = Embedder(packaged_embedder_path())
    report: dict = {"total": args.total, "build": build(settings, embedder, args.total, args.base)}
    print("built", report["build"], flush=True)
    del embedder
    report["ready_s"] = [serve_to_ready(data_dir, tmp / f"serve{i}.log") for i in range(args.runs)]
    report["ready_s_median"] = float(np.median(report["ready_s"]))
    # the same with BM25 from the tantivy index: its ids are read and checked against the rows
    tantivy = [
        serve_to_ready(data_dir, tmp / f"serve_tantivy{i}.log", "tantivy") for i in range(args.runs)
    ]
    report["ready_s_tantivy"] = tantivy
    report["ready_s_tantivy_median"] = float(np.median(tantivy))
    # the floor no corpus work can lower: the same server over an empty data dir
    empty = [serve_to_ready(tmp / "empty", tmp / f"empty{i}.log") for i in range(args.runs)]
    report["ready_s_empty_data_dir_median"] = float(np.median(empty))
    report["import_sentence_transformers_s"] = import_seconds("sentence_transformers")
    report["goal_s"] = GOAL_S
    report["meets_goal"] = report["ready_s_median"] <= GOAL_S
    report["meets_goal_tantivy"] = report["ready_s_tantivy_median"] <= GOAL_S
    report["parts"] = parts(settings)
    report["load_average_1m"] = os.getloadavg()[0]
    return report


def main() -> None:
    parser = scale_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    run_in_tmp(parser.parse_args(), run, RESULTS)


if __name__ == "__main__":
    main()
