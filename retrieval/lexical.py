"""A mutable BM25 inverted index over chunks, keyed by the same int64 ids as the vector index."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixrag.retrieval.analyzer import Analyzer


def searchable_text(text: str, heading: str | None) -> str:
    """What BM25 indexes for a chunk: its heading path (naming e.g. the API entry), then text."""
    return f"{heading}\n{text}" if heading else text


@dataclass(slots=True)
class BM25Params:
    """Okapi BM25 constants: `k1` saturates term frequency, `b` normalizes by length."""

    k1: float = 1.2
    b: float = 0.75

    def __post_init__(self) -> None:
        if not (math.isfinite(self.k1) and self.k1 >= 0):
            raise ValueError(f"k1 must be a finite number >= 0, got {self.k1}")
        if not 0.0 <= self.b <= 1.0:
            raise ValueError(f"b must be in [0, 1], got {self.b}")


class LexicalIndex:
    """Chunks' terms in an inverted index, scored by BM25 (Lucene's non-negative idf).

    score(q, d) = sum over query terms t in d of
        idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * len(d) / avg_len))
    with idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)), over the chunks held now; a query
    term counts once per occurrence in the query. Every method takes one lock, so ingest threads
    may add and remove while others search.
    """

    def __init__(self, analyzer: Analyzer | None = None, params: BM25Params | None = None) -> None:
        self.analyzer = analyzer if analyzer is not None else Analyzer()
        self.params = params if params is not None else BM25Params()
        self._lock = threading.Lock()
        # postings: term -> {slot: tf}; a slot is a chunk's row in the per-chunk arrays below
        self._postings: dict[str, dict[int, int]] = {}
        self._slot_terms: dict[int, tuple[str, ...]] = {}  # forward index, so removal is cheap
        self._slot_of: dict[int, int] = {}
        self._slot_ids = np.zeros(0, dtype=np.int64)
        self._slot_lens = np.zeros(0, dtype=np.float64)
        self._num_slots = 0
        self._free_slots: list[int] = []
        self._total_len = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def ids(self) -> np.ndarray:
        """The ids held, sorted, as int64."""
        with self._lock:
            return np.sort(np.fromiter(self._slot_of, dtype=np.int64, count=len(self._slot_of)))

    def add(self, ids: np.ndarray, texts: Sequence[str]) -> None:
        """Index `texts` under `ids`; an id already held raises ValueError and nothing changes."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("ids must be unique")
        # outside the lock: the slow part
        term_counts = [self.analyzer.term_counts(t) for t in texts]
        with self._lock:
            held = [int(i) for i in ids if int(i) in self._slot_of]
            if held:
                raise ValueError(f"ids already indexed: {held[:5]}")
            for chunk_id, counts in zip(ids.tolist(), term_counts, strict=True):
                self._insert(chunk_id, counts)

    def remove(self, ids: np.ndarray) -> int:
        """Drop the given ids (unknown ones are ignored); returns how many were removed."""
        removed = 0
        with self._lock:
            for chunk_id in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
                slot = self._slot_of.pop(chunk_id, None)
                if slot is not None:
                    self._delete(slot)
                    removed += 1
        return removed

    def reset(self) -> None:
        """Remove every chunk."""
        with self._lock:
            self._postings.clear()
            self._slot_terms.clear()
            self._slot_of.clear()
            self._free_slots.clear()
            self._num_slots = 0
            self._total_len = 0

    def search(
        self, query: str, k: int, allowed_ids: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks among `allowed_ids` (None = all), best first.

        Only chunks sharing at least one term with the query are returned, so there may be
        fewer than k; ties keep the lower id first.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        query_terms = self.analyzer.terms(query)
        with self._lock:
            scores = self._score_all(query_terms)
            slot_ids = self._slot_ids[: self._num_slots].copy()
        live = scores > 0
        if allowed_ids is not None:
            live &= np.isin(slot_ids, np.asarray(allowed_ids, dtype=np.int64))
        hit_scores, hit_ids = scores[live], slot_ids[live]
        order = np.lexsort((hit_ids, -hit_scores))[:k]
        return hit_scores[order].astype(np.float32), hit_ids[order]

    # internals: callers hold the lock

    def _insert(self, chunk_id: int, counts: dict[str, int]) -> None:
        slot = self._free_slots.pop() if self._free_slots else self._new_slot()
        length = sum(counts.values())
        self._slot_of[chunk_id] = slot
        self._slot_ids[slot] = chunk_id
        self._slot_lens[slot] = length
        self._total_len += length
        self._slot_terms[slot] = tuple(counts)
        for term, tf in counts.items():
            self._postings.setdefault(term, {})[slot] = tf

    def _new_slot(self) -> int:
        if self._num_slots == len(self._slot_ids):
            grown = max(1024, 2 * len(self._slot_ids))
            self._slot_ids = np.resize(self._slot_ids, grown)
            self._slot_lens = np.resize(self._slot_lens, grown)
        self._num_slots += 1
        return self._num_slots - 1

    def _delete(self, slot: int) -> None:
        self._total_len -= int(self._slot_lens[slot])
        self._slot_lens[slot] = 0
        self._slot_ids[slot] = -1
        self._free_slots.append(slot)
        for term in self._slot_terms.pop(slot):
            posting = self._postings[term]
            del posting[slot]
            if not posting:
                del self._postings[term]

    def _score_all(self, query_terms: list[str]) -> np.ndarray:
        num_docs = len(self._slot_of)
        scores = np.zeros(self._num_slots, dtype=np.float64)
        if num_docs == 0:
            return scores
        k1, b = self.params.k1, self.params.b
        avg_len = self._total_len / num_docs
        norm = k1 * (1.0 - b + b * self._slot_lens[: self._num_slots] / max(avg_len, 1e-9))
        for term in query_terms:
            posting = self._postings.get(term)
            if not posting:
                continue
            df = len(posting)
            idf = math.log(1.0 + (num_docs - df + 0.5) / (df + 0.5))
            slots = np.fromiter(posting.keys(), dtype=np.int64, count=df)
            tf = np.fromiter(posting.values(), dtype=np.float64, count=df)
            scores[slots] += idf * tf * (k1 + 1.0) / (tf + norm[slots])
        return scores
