"""BM25 over chunk terms in a tantivy index on disk: the lexical engine for large libraries.

Inside the database (app/services/lexical.py), FTS5 and PostgreSQL score every chunk that
shares a term with the query. A 12-word question matches most of a million chunks, and scoring
them alone takes over half a second (bench/lexical_scale_bench.py). tantivy, a search library in
Rust built the way Lucene is, keeps a score bound per block of each posting list and skips every
block that cannot enter the current top k (block-max WAND). That is tens of milliseconds on the
same million chunks (bench/hybrid_bench.py).

This index is derived from the database, as the vector index is. The chunk rows, with their
terms in FTS5 or tsvector, stay the record; this one is added to and removed from beside the
vector index, and the start-up check repairs it from the rows
(app/services/index_sync.py). It stores our Analyzer's terms verbatim through a whitespace
tokenizer, as the database stores do, so the analysis is the same. The ranking differs only in
tantivy's BM25 details:
- idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)), Lucene's (FTS5's has no "1 +");
- a chunk's length is kept in one byte: exact up to 40 terms, coarser above;
- N, df and the average length count deleted chunks until their segment is merged.

Filters are terms of the chunk's document and collection, applied inside the query.
One writer per index: a second process opening the same directory to write fails on tantivy's
lock, never corrupts it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tantivy

# Not persisted by tantivy: registered again every time the index is opened.
_TOKENIZER = "prefixrag_terms"
_WRITER_HEAP_BYTES = 64 * 1024 * 1024
# One indexing thread: ingest writes one document's chunks at a time, and searches run beside.
_WRITER_THREADS = 1


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("chunk_id", indexed=True, fast=True)
    builder.add_integer_field("document_id", indexed=True)
    builder.add_integer_field("collection_id", indexed=True)
    # term frequencies, no positions: BM25 needs nothing else
    builder.add_text_field("terms", tokenizer_name=_TOKENIZER, index_option="freq")
    return builder.build()


class TantivyLexical:
    """The chunks' terms in a tantivy index at `path` (a directory, created when missing).

    Every change is committed before its call returns, and searches see it from then on.
    Thread-safe: writes are serialized, searches take the last committed view. With
    `writable=False` it only searches what was committed when it opened, and opens beside the
    process that writes.
    """

    def __init__(self, path: Path, *, writable: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._schema = _schema()
        self._index = tantivy.Index(self._schema, path=str(path))
        self._index.register_tokenizer(
            _TOKENIZER, tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build()
        )
        self._writer = self._index.writer(_WRITER_HEAP_BYTES, _WRITER_THREADS) if writable else None
        self._lock = threading.Lock()
        self._searcher = self._index.searcher()

    def add(
        self,
        chunk_ids: Sequence[int] | np.ndarray,
        terms: Sequence[Sequence[str]],
        *,
        document_ids: Sequence[int] | np.ndarray,
        collection_ids: Sequence[int] | np.ndarray,
    ) -> None:
        """Index chunks: `terms[i]` are chunk `chunk_ids[i]`'s terms, and it belongs to document
        `document_ids[i]` of collection `collection_ids[i]`. One commit for the whole call.

        A chunk id already held is replaced, so adding again (a repair) never duplicates it.
        """
        if not len(chunk_ids) == len(terms) == len(document_ids) == len(collection_ids):
            raise ValueError(
                f"{len(chunk_ids)} ids for {len(terms)} term lists, {len(document_ids)} "
                f"document ids and {len(collection_ids)} collection ids"
            )
        with self._lock:
            for chunk_id, chunk_terms, document_id, collection_id in zip(
                chunk_ids, terms, document_ids, collection_ids, strict=True
            ):
                self._w.delete_documents_by_term("chunk_id", int(chunk_id))
                doc = tantivy.Document()
                doc.add_integer("chunk_id", int(chunk_id))
                doc.add_integer("document_id", int(document_id))
                doc.add_integer("collection_id", int(collection_id))
                doc.add_text("terms", " ".join(chunk_terms))
                self._w.add_document(doc)
            self._commit()

    def remove(self, chunk_ids: Sequence[int] | np.ndarray) -> None:
        """Drop these chunks (ids not held are ignored)."""
        if len(chunk_ids) == 0:
            return
        with self._lock:
            for chunk_id in chunk_ids:
                self._w.delete_documents_by_term("chunk_id", int(chunk_id))
            self._commit()

    def reset(self) -> None:
        """Drop every chunk."""
        with self._lock:
            self._w.delete_all_documents()
            self._commit()

    def search(
        self,
        terms: Sequence[str],
        k: int,
        *,
        collection_ids: Sequence[int] | None = None,
        document_ids: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks holding any of `terms`, best first, within
        `collection_ids` and `document_ids` (None = any). A term repeated in `terms` counts once
        per occurrence, as in the database stores. Equal scores keep the lower id first, among
        the chunks tantivy returned."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not terms or (collection_ids is not None and not collection_ids):
            return _empty()
        if document_ids is not None and not document_ids:
            return _empty()
        should = [
            (tantivy.Occur.Should, tantivy.Query.term_query(self._schema, "terms", t))
            for t in terms
        ]
        query = tantivy.Query.boolean_query(should)
        must = [(tantivy.Occur.Must, query)]
        for field, values in (("collection_id", collection_ids), ("document_id", document_ids)):
            if values is not None:
                keys = [int(v) for v in values]
                allowed = tantivy.Query.term_set_query(self._schema, field, keys)
                # a filter adds nothing to the score: BM25 alone ranks
                must.append((tantivy.Occur.Must, tantivy.Query.const_score_query(allowed, 0.0)))
        if len(must) > 1:
            query = tantivy.Query.boolean_query(must)
        searcher = self._searcher
        hits = searcher.search(query, k).hits
        if not hits:
            return _empty()
        ids = searcher.fast_field_values("chunk_id", [address for _, address in hits])
        scores = np.asarray([score for score, _ in hits], dtype=np.float32)
        chunk_ids = np.asarray(ids, dtype=np.int64)
        order = np.lexsort((chunk_ids, -scores))
        return scores[order], chunk_ids[order]

    def ids(self) -> np.ndarray:
        """Every chunk id held, sorted, as int64 (about 0.4 s at a million chunks)."""
        searcher = self._searcher
        if searcher.num_docs == 0:
            return np.zeros(0, dtype=np.int64)
        hits = searcher.search(tantivy.Query.all_query(), searcher.num_docs).hits
        ids = searcher.fast_field_values("chunk_id", [address for _, address in hits])
        return np.sort(np.asarray(ids, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._searcher.num_docs)

    def close(self) -> None:
        """Let go of the writer's lock on the directory (waiting for its merges)."""
        with self._lock:
            if self._writer is not None:
                self._writer.wait_merging_threads()
                self._writer = None

    @property
    def _w(self) -> tantivy.IndexWriter:
        if self._writer is None:
            raise RuntimeError(f"{self.path} was opened read-only, or closed")
        return self._writer

    def _commit(self) -> None:
        self._w.commit()
        self._index.reload()
        self._searcher = self._index.searcher()


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
