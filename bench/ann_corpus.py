"""A million-chunk corpus of real embeddings for the ANN benchmark, cached under bench/.cache.

Base: real text from the Debian docs on disk (/usr/share/doc: HTML, Markdown, plain text and
gzipped READMEs, NEWS and changelogs), files in a seeded shuffle, cut by the service's own Chunker
(128 tokens, 24 overlap: the default settings), exact duplicate chunks dropped (licence texts
repeat across packages), and embedded once with the packaged all-MiniLM-L6-v2.

Queries: real chunks not in the base, at most 2 per file, from the end of the shuffle backwards
(so they spread over ~250 files), cut to their first 12 words (question-length real text),
embedded with the same model.

Variants (to reach 1M without embedding 1M texts on 2 shared cores): every vector beyond the base
is a re-normalized mix of two real embeddings, w * e_i + (1 - w) * e_j, with i a base chunk, j one
of i's 20 nearest base neighbours and w uniform in [0.55, 0.95]. Such a mix is what a related
passage (a reworded or neighbouring section) looks like to the model: it stays on the part of the
sphere real text occupies, keeps its cluster structure, and is not a duplicate of either parent.
The variant's text (for the lexical side) is its parent i's text: FTS5 sees the docs repeated.
This is vector-level mixing, not new text: the figures say so.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np

from prefixrag.retrieval.chunking import Chunker
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.parsing import DocumentParseError, parse_document

DOC_ROOT = Path("/usr/share/doc")
CACHE = Path(__file__).parent / ".cache"
CHUNK_TOKENS, CHUNK_OVERLAP = 128, 24
QUERY_WORDS = 12
QUERIES_PER_FILE = 2
NEIGHBOURS = 20
MIX_WEIGHTS = (0.55, 0.95)
_TEXT_TYPES = {".html": "text/html", ".htm": "text/html", ".md": "text/markdown"}


def doc_files(root: Path = DOC_ROOT, seed: int = 0) -> list[Path]:
    """Readable text files under `root`, in a seeded shuffle (so the base mixes packages)."""
    files = [
        p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and _media_type(p) is not None
    ]
    files.sort()
    random.Random(seed).shuffle(files)
    return files


def _media_type(path: Path) -> str | None:
    name = path.name.removesuffix(".gz").lower()
    suffix = Path(name).suffix
    if suffix in _TEXT_TYPES:
        return _TEXT_TYPES[suffix]
    if suffix in (".txt", "") or name.startswith(("readme", "news", "changelog", "copyright")):
        return "text/plain"
    return None


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


def real_chunks(embedder: Embedder, num_chunks: int) -> list[str]:
    """The first `num_chunks` distinct chunk texts of the shuffled Debian docs."""
    chunker = Chunker(embedder.count_tokens, CHUNK_TOKENS, CHUNK_OVERLAP)
    seen: set[bytes] = set()
    texts: list[str] = []
    for path in doc_files():
        try:
            parsed = parse_document(_read(path), _media_type(path) or "text/plain")
        except (DocumentParseError, OSError, EOFError, gzip.BadGzipFile):
            continue  # binary, not UTF-8, or empty: not text this benchmark can use
        for chunk in chunker.split(parsed):
            key = hashlib.sha1(chunk.text.encode()).digest()
            if len(chunk.text.split()) < 8 or key in seen:
                continue
            seen.add(key)
            texts.append(chunk.text)
            if len(texts) == num_chunks:
                return texts
    raise RuntimeError(f"the docs hold only {len(texts)} distinct chunks, {num_chunks} wanted")


def base_set(embedder: Embedder, num_base: int, num_queries: int) -> dict:
    """Base texts and vectors, and query texts and vectors; each computed once, then cached.

    Also says how fast the base embedded (chunks per second), measured when first computed.
    """
    base = _cached(f"ann_base_{num_base}", lambda: _embed_base(embedder, num_base))
    queries = _cached(
        f"ann_queries_{num_base}_{num_queries}",
        lambda: _embed_queries(embedder, num_base, num_queries),
    )
    return {**base, **queries}


def _cached(name: str, compute) -> dict:  # type: ignore[no-untyped-def]
    arrays_path, meta_path = CACHE / f"{name}.npz", CACHE / f"{name}.json"
    if arrays_path.exists() and meta_path.exists():
        return {**json.loads(meta_path.read_text()), **np.load(arrays_path)}
    meta, arrays = compute()
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(arrays_path, **arrays)
    meta_path.write_text(json.dumps(meta))
    return {**meta, **arrays}


def _embed_base(embedder: Embedder, num_base: int) -> tuple[dict, dict]:
    texts = real_chunks(embedder, num_base)
    t0 = time.perf_counter()
    vectors = embedder.encode(texts, show_progress=True)
    embed_s = time.perf_counter() - t0
    meta = {"texts": texts, "embed_s": embed_s, "embed_chunks_per_s": num_base / embed_s}
    return meta, {"vectors": vectors}


def _embed_queries(embedder: Embedder, num_base: int, num_queries: int) -> tuple[dict, dict]:
    texts = query_chunks(embedder, set(_cached_base_texts(num_base)), num_queries)
    queries = [" ".join(t.split()[:QUERY_WORDS]) for t in texts]
    return {"queries": queries}, {"query_vectors": embedder.encode(queries)}


def _cached_base_texts(num_base: int) -> list[str]:
    return json.loads((CACHE / f"ann_base_{num_base}.json").read_text())["texts"]


def base_texts(embedder: Embedder, num_base: int) -> list[str]:
    """The base chunk texts: from the cache when the base was embedded, else cut again (the
    chunker only: for benchmarks that need the texts and not the vectors)."""
    if (CACHE / f"ann_base_{num_base}.json").exists():
        return list(_cached_base_texts(num_base))
    return real_chunks(embedder, num_base)


def query_chunks(embedder: Embedder, base: set[str], num: int) -> list[str]:
    """Real chunks none of which is in `base`: at most QUERIES_PER_FILE per file, from the end
    of the shuffle backwards (the base took files from its start), so they spread over files."""
    chunker = Chunker(embedder.count_tokens, CHUNK_TOKENS, CHUNK_OVERLAP)
    out: list[str] = []
    for path in reversed(doc_files()):
        try:
            parsed = parse_document(_read(path), _media_type(path) or "text/plain")
        except (DocumentParseError, OSError, EOFError, gzip.BadGzipFile):
            continue
        chunks = [c.text for c in chunker.split(parsed) if len(c.text.split()) >= 2 * QUERY_WORDS]
        out += [t for t in chunks if t not in base][:QUERIES_PER_FILE]
        if len(out) >= num:
            return out[:num]
    raise RuntimeError(f"only {len(out)} query chunks found, {num} wanted")


def nearest_base_neighbours(vectors: np.ndarray, k: int = NEIGHBOURS) -> np.ndarray:
    """[n, k] indexes of each base vector's k nearest other base vectors (exact, by blocks)."""
    out = np.empty((len(vectors), k), dtype=np.int64)
    for start in range(0, len(vectors), 2048):
        sims = vectors[start : start + 2048] @ vectors.T
        rows = np.arange(len(sims))
        sims[rows, rows + start] = -np.inf  # not its own neighbour
        top = np.argpartition(-sims, k, axis=1)[:, :k]
        out[start : start + len(sims)] = top
    return out


def variants(
    vectors: np.ndarray, neighbours: np.ndarray, num: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """`num` mixed vectors (float32 [num, d], unit norm) and each one's parent base index."""
    rng = np.random.default_rng(seed)
    parents = rng.integers(0, len(vectors), num)
    partners = neighbours[parents, rng.integers(0, neighbours.shape[1], num)]
    weights = rng.uniform(*MIX_WEIGHTS, num).astype(np.float32)[:, None]
    mixed = np.empty((num, vectors.shape[1]), dtype=np.float32)
    for start in range(0, num, 65536):  # by blocks: the temporaries stay small
        s = slice(start, start + 65536)
        block = weights[s] * vectors[parents[s]] + (1 - weights[s]) * vectors[partners[s]]
        mixed[s] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return mixed, parents


def corpus(embedder: Embedder, num_total: int, num_base: int, num_queries: int) -> dict:
    """`num_total` unit vectors (the base first, then variants), each row's text index into
    `texts`, and the query texts and vectors."""
    base = base_set(embedder, num_base, num_queries)
    real = base["vectors"]
    num_variants = max(0, num_total - len(real))
    mixed, parents = variants(real, nearest_base_neighbours(real), num_variants)
    return {
        **base,
        "vectors": np.vstack([real[:num_total], mixed]),
        "text_of": np.concatenate([np.arange(min(num_total, len(real))), parents]),
        "num_real": min(num_total, len(real)),
    }
