"""Retrieval quality on the Python 3.11 docs: recall@1/5/10 and MRR per chunking and variant.

Needs Debian's python3.11-doc (HTML under /usr/share/doc/python3.11/html). The questions in
bench/data/python_docs_qa.json are paraphrases; a chunk is relevant when it contains one of the
question's answer strings verbatim. Chunk embeddings are cached under bench/.cache, keyed by the
model and the exact chunk texts, so fusion variants never re-embed.

Every variant is scored on both halves of bench/eval_split.py. Settings are chosen on "tune"
(the fusion variant `best on tune` names), and the figures to quote are "held_out", which no
setting was chosen on.

    python -m bench.retrieval_eval [--configs 128:24,200:32] [--structure definitions,headings]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.eval_split import HALVES, half_of
from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.retrieval.chunking import Chunk, Chunker
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.fusion import rrf_fuse
from prefixrag.retrieval.html_text import html_to_text
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.lexical.fts5_index import Fts5Index
from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from prefixrag.retrieval.lexical.terms import index_terms, searchable_text
from prefixrag.retrieval.parsing import ParsedDocument, Section
from prefixrag.retrieval.pipeline import Retriever, TextPassage
from prefixrag.retrieval.vector_index import VectorIndex

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
DATA = Path(__file__).parent / "data" / "python_docs_qa.json"
RESULTS = Path(__file__).parent / "results" / "retrieval_eval.json"
PLOT = RESULTS.with_suffix(".png")
SHIPPED = "shipped: Retriever, settings' hybrid defaults"
SHIPPED_TANTIVY = "shipped, lexical_engine tantivy"
BEST_ON_TUNE = "best on tune (fusion grid)"
PLOTTED = ("dense", "bm25_heading+text", BEST_ON_TUNE, SHIPPED, SHIPPED_TANTIVY)
CACHE = Path(__file__).parent / ".cache"
KS = (1, 5, 10)
CANDIDATES = 50
FUSION_GRID = [(k, w) for k in (10, 30, 60) for w in (0.5, 1.0, 1.5, 2.0)]  # (rrf_k, bm25 weight)


def parse(name: str, definitions: bool) -> ParsedDocument:
    text, headings, title = html_to_text((DOC_ROOT / name).read_bytes(), definitions=definitions)
    sections = [Section(start, level, heading) for start, level, heading in headings]
    return ParsedDocument(text, "text/html", None, sections, title)


def load_chunks(docs: list[str], chunker: Chunker, definitions: bool) -> list[Chunk]:
    """Every chunk of every document of the eval set, in document order."""
    return [c for name in docs for c in chunker.split(parse(name, definitions))]


def cached_embeddings(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """Embeddings of `texts`, from bench/.cache when these exact texts were embedded before."""
    digest = hashlib.sha256(embedder.model_name_or_path.encode())
    for text in texts:
        digest.update(text.encode() + b"\x00")
    path = CACHE / f"emb-{digest.hexdigest()[:24]}.npy"
    if path.exists():
        return np.load(path)
    vectors = embedder.encode(texts, show_progress=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vectors)
    os.replace(tmp, path)
    return vectors


def first_relevant_rank(ranked_ids: list[int], texts: list[str], answers: list[str]) -> int | None:
    for rank, chunk_id in enumerate(ranked_ids):
        if any(a in texts[chunk_id] for a in answers):
            return rank
    return None


def evaluate(questions: list[dict], texts: list[str], rankings: list[list[int]]) -> dict:
    """Recall and MRR on each half of the questions (and on all of them)."""
    halves: dict[str, list[int]] = {h: [] for h in HALVES}
    for i, q in enumerate(questions):
        halves[half_of(q["q"])].append(i)
    out = {"all": _evaluate(questions, texts, rankings)}
    for half, rows in halves.items():
        out[half] = _evaluate([questions[i] for i in rows], texts, [rankings[i] for i in rows])
    return out


def _evaluate(questions: list[dict], texts: list[str], rankings: list[list[int]]) -> dict:
    ranks = [
        first_relevant_rank(r[:10], texts, q["a"]) for q, r in zip(questions, rankings, strict=True)
    ]
    out = {f"recall@{k}": float(np.mean([r is not None and r < k for r in ranks])) for k in KS}
    out["mrr@10"] = float(np.mean([1.0 / (r + 1) if r is not None else 0.0 for r in ranks]))
    out["misses_at_5"] = [
        q["q"] for q, r in zip(questions, ranks, strict=True) if r is None or r >= 5
    ]
    return out


def run_config(
    embedder: Embedder, spec: dict, size: int, overlap: int, definitions: bool
) -> dict[str, dict]:
    """Every retrieval variant on one chunking of the corpus."""
    questions = spec["questions"]
    chunker = Chunker(embedder.count_tokens, size, overlap)
    chunks = load_chunks(spec["documents"], chunker, definitions)
    texts = [c.text for c in chunks]
    print(f"{len(texts)} chunks", flush=True)
    ids = np.arange(len(texts), dtype=np.int64)
    t0 = time.perf_counter()
    index = VectorIndex(embedder.dim, use_gpu="no")
    index.add(ids, cached_embeddings(embedder, texts))
    embed_s = time.perf_counter() - t0
    lexical = {name: Fts5Index(analyzer) for name, analyzer in ANALYZERS.items()}
    for lex in lexical.values():
        lex.add(ids, texts)
    with_heading = Fts5Index()  # what the service indexes (SQLite FTS5, as the service's DB)
    with_heading.add(ids, [searchable_text(c.text, c.heading) for c in chunks])

    query_vectors = embedder.encode([q["q"] for q in questions])
    dense = [index.search(v, CANDIDATES)[1][0].tolist() for v in query_vectors]
    results: dict[str, dict] = {"dense": evaluate(questions, texts, dense)}
    lex_runs = {name: _lexical_run(lex, questions) for name, lex in lexical.items()}
    lex_runs["bm25_heading+text"] = _lexical_run(with_heading, questions)
    for name, run in lex_runs.items():
        results[name] = evaluate(questions, texts, run)
    for lex_name in ("bm25", "bm25_heading+text"):
        for k, w in FUSION_GRID:
            pairs = zip(dense, lex_runs[lex_name], strict=True)
            fused = [rrf_fuse([d, lx], [1.0, w], k) for d, lx in pairs]
            results[f"rrf[{lex_name}] k={k} w={w}"] = evaluate(questions, texts, fused)
    defaults = Settings()
    shipped = Retriever(
        embedder,
        index,
        None,
        lexical=with_heading,
        lexical_weight=defaults.hybrid_bm25_weight,
        rrf_k=defaults.hybrid_rrf_k,
    )
    results[SHIPPED] = evaluate(
        questions, texts, [_retrieve(shipped, q["q"], texts) for q in tqdm(questions, "shipped")]
    )
    # the same, with BM25 from the tantivy store (settings.lexical_engine = "tantivy")
    with tempfile.TemporaryDirectory() as tmp:
        tantivy = TantivyText(Path(tmp), ids, [searchable_text(c.text, c.heading) for c in chunks])
        lex_runs["bm25_heading+text tantivy"] = _lexical_run(tantivy, questions)
        results["bm25_heading+text tantivy"] = evaluate(
            questions, texts, lex_runs["bm25_heading+text tantivy"]
        )
        with_tantivy = Retriever(
            embedder,
            index,
            None,
            lexical=tantivy,
            lexical_weight=defaults.hybrid_bm25_weight,
            rrf_k=defaults.hybrid_rrf_k,
        )
        runs = [_retrieve(with_tantivy, q["q"], texts) for q in tqdm(questions, "tantivy")]
        results[SHIPPED_TANTIVY] = evaluate(questions, texts, runs)
        tantivy.store.close()
    fused = [name for name in results if name.startswith("rrf[")]
    best = max(fused, key=lambda n: (results[n]["tune"]["recall@5"], results[n]["tune"]["mrr@10"]))
    results[BEST_ON_TUNE] = {**results[best], "variant": best}
    answerable = sum(any(a in t for t in texts for a in q["a"]) for q in questions)
    meta = {
        "chunks": len(texts),
        "answerable_in_some_chunk": answerable,
        "embed_or_cache_seconds": round(embed_s, 1),
    }
    return {"meta": meta, "results": results}


ANALYZERS: dict[str, Analyzer] = {
    "bm25_plain_words": Analyzer(stop_words=False, stem=False, split_identifiers=False),
    "bm25_stop": Analyzer(stop_words=True, stem=False, split_identifiers=False),
    "bm25_stop+split": Analyzer(stop_words=True, stem=False, split_identifiers=True),
    "bm25": Analyzer(),  # the shipped analyzer: stop words, identifier parts, light stemming
}


class TantivyText:
    """The tantivy store of settings.lexical_engine "tantivy" over bare ids and texts, searched
    with the shipped analyzer (the service's side is app/services/lexical.py)."""

    def __init__(self, path: Path, ids: np.ndarray, texts: list[str]) -> None:
        self.analyzer = Analyzer()
        self.store = TantivyLexical(path)
        zeros = [0] * len(texts)
        terms = [index_terms(self.analyzer, t) for t in texts]
        self.store.add(ids, terms, document_ids=zeros, collection_ids=zeros)

    def search(self, query: str, k: int, scope: object = None) -> tuple[np.ndarray, np.ndarray]:
        return self.store.search(index_terms(self.analyzer, query), k)


def _lexical_run(lex: Fts5Index | TantivyText, questions: list[dict]) -> list[list[int]]:
    return [lex.search(q["q"], CANDIDATES)[1].tolist() for q in questions]


def _retrieve(retriever: Retriever, query: str, texts: list[str]) -> list[int]:
    fetch: Callable[[list[int]], dict[int, TextPassage]] = lambda ids: {  # noqa: E731
        i: TextPassage(texts[i]) for i in ids
    }
    result = retriever.retrieve(
        query, top_k=10, candidates=CANDIDATES, allowed_ids=None, load_passages=fetch
    )
    return [h.chunk_id for h in result.hits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="128:24,200:32", help="chunk:overlap,...")
    parser.add_argument(
        "--structure",
        default="definitions,headings",
        help="definitions: API entries (<dt id>) are sections too (the parser's default); "
        "headings: h1-h6 sections only",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(DATA.read_text())
    embedder = Embedder(packaged_embedder_path())
    report: dict = {"questions": len(spec["questions"]), "documents": len(spec["documents"])}
    report["held_out_questions"] = sum(half_of(q["q"]) == "held_out" for q in spec["questions"])
    report["candidates"] = CANDIDATES
    report["configs"] = {}
    for structure in args.structure.split(","):
        for config in args.configs.split(","):
            size, overlap = (int(x) for x in config.split(":"))
            name = f"{structure} {size}:{overlap}"
            print(f"== {name}", flush=True)
            out = run_config(embedder, spec, size, overlap, structure == "definitions")
            report["configs"][name] = out
            print_table(name, out)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    plot(report)


def plot(report: dict) -> None:
    """Held-out recall@5 and @10 of the main variants per chunking config, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(report["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    width = 0.8 / len(PLOTTED)
    for ax, k in zip(axes, (5, 10), strict=True):
        for i, variant in enumerate(PLOTTED):
            values = [
                report["configs"][c]["results"][variant]["held_out"][f"recall@{k}"] for c in configs
            ]
            ax.bar(np.arange(len(configs)) + i * width, values, width, label=variant)
        centre = width * (len(PLOTTED) - 1) / 2
        ax.set_xticks(np.arange(len(configs)) + centre, configs, rotation=15, fontsize=8)
        ax.set_title(f"held-out recall@{k}, {report['held_out_questions']} questions")
        ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    handles, labels = axes[0].get_legend_handles_labels()
    # below the bars, not over them
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def print_table(name: str, out: dict) -> None:
    print(f"\n{name}: {out['meta']}")
    head = f"{'variant':46} {'tune R@5':>9} | {'held-out R@1':>12}"
    print(f"{head} {'R@5':>6} {'R@10':>6} {'MRR':>6}")
    for variant, r in out["results"].items():
        t, h = r["tune"], r["held_out"]
        print(
            f"{variant:46} {t['recall@5']:9.3f} | {h['recall@1']:12.3f} {h['recall@5']:6.3f} "
            f"{h['recall@10']:6.3f} {h['mrr@10']:6.3f}",
            flush=True,
        )
    print(f"best on tune: {out['results'][BEST_ON_TUNE]['variant']}")


if __name__ == "__main__":
    main()
