"""Lexical (BM25) search: what a chunk indexes, the terms stored for it, and the search interface.

The text search engines (SQLite FTS5, PostgreSQL tsvector) never analyze text themselves: our
Analyzer turns a chunk into terms in Python, the engine stores those terms verbatim, and a query
is analyzed the same way. So every store ranks the same terms, whatever its own tokenizer does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import numpy as np

from prefixrag.retrieval.lexical.analyzer import Analyzer

# PostgreSQL refuses a lexeme of 2 KiB or more; every store drops such terms, so they agree.
MAX_TERM_BYTES = 2046
# FTS5's bm25() constants (fixed inside SQLite); the PostgreSQL store uses the same.
BM25_K1 = 1.2
BM25_B = 0.75


class LexicalSearch(Protocol):
    """A BM25 store the Retriever can query; `scope` is the store's own filter (None = all)."""

    def search(self, query: str, k: int, scope: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the best `k` chunks within `scope` sharing a term with `query`,
        best first (float32 scores, higher is better; int64 ids)."""
        ...


def searchable_text(text: str, heading: str | None) -> str:
    """What BM25 indexes for a chunk: its heading path (naming e.g. the API entry), then text."""
    return f"{heading}\n{text}" if heading else text


def index_terms(analyzer: Analyzer, text: str) -> list[str]:
    """The terms a store keeps for `text` (or a query), in order: the analyzer's, minus any too
    long for every store to hold."""
    return [t for t in analyzer.terms(text) if len(t.encode()) <= MAX_TERM_BYTES]


def fts5_match(terms: list[str]) -> str:
    """An FTS5 MATCH expression: any of `terms` (OR), each quoted so it is one literal token.

    A term repeated in the query is repeated here, and bm25() then counts it once per
    occurrence. Terms are runs of word characters, so they never hold a double quote.
    """
    return " OR ".join(f'"{t}"' for t in terms)


def tsvector_literal(terms: list[str]) -> str:
    """`terms` as a PostgreSQL tsvector literal that keeps each term verbatim and its count.

    A lexeme's count is its number of positions; positions are numbered 1..count per lexeme
    (they only need to be distinct), because PostgreSQL keeps at most 256 per lexeme and caps
    their values at 16383. So a term's frequency is exact up to 256 (BM25 has long saturated by
    then). Terms hold no quote or backslash (word characters only), so none needs escaping.
    """
    return " ".join(
        f"'{term}':{','.join(str(p) for p in range(1, min(tf, 256) + 1))}"
        for term, tf in Counter(terms).items()
    )
