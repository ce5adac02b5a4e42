"""Lexical (BM25) search, one interface with two kinds of engine behind it.

- ``analyzer``: text to the terms BM25 counts, the same for every engine;
- ``terms``: what a chunk indexes, the stored form of its terms, the BM25 constants and the
  :class:`LexicalSearch` interface every engine meets;
- ``fts5_index``: a standalone SQLite FTS5 index, for benchmarks and tests that hold ids and
  texts but no service database;
- ``tantivy_index``: a tantivy index on disk (block-max WAND), for large libraries.

The service's side, inside its database (FTS5 or PostgreSQL tsvector) or over tantivy, is one
adapter: app/services/lexical.py.
"""
