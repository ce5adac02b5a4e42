"""Sentence embeddings (sentence-transformers) and the matching token counter."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np


class Embedder:
    """A sentence-transformers bi-encoder that returns L2-normalized float32 vectors.

    `count_tokens` uses the model's own tokenizer, so chunk sizes match what the model sees;
    `max_seq_length` is how many tokens the model reads before truncating. The last
    `cache_queries` query vectors are kept: a conversation's follow-up embeds its earlier
    questions again (to recover their chunks and key lines), at about 30 ms each on CPU.
    """

    def __init__(
        self,
        model_name_or_path: str,
        device: str | None = None,
        batch_size: int = 64,
        cache_queries: int = 1024,
    ) -> None:
        if batch_size < 1 or cache_queries < 0:
            raise ValueError(
                f"need batch_size >= 1, cache_queries >= 0: {batch_size}, {cache_queries}"
            )
        from sentence_transformers import SentenceTransformer

        self.model_name_or_path = model_name_or_path
        self.batch_size = batch_size
        self.model = SentenceTransformer(model_name_or_path, device=device)
        dim = self.model.get_embedding_dimension()
        if not dim:
            raise ValueError(f"can't tell the embedding size of {model_name_or_path!r}")
        self.dim: int = int(dim)
        self.max_seq_length: int = int(self.model.max_seq_length or 512)
        self._counter = _untruncated_copy(self.model.tokenizer)
        self.cache_queries = cache_queries
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def count_tokens(self, text: str) -> int:
        """How many tokens the model's tokenizer makes of `text`, special tokens excluded."""
        if self._counter is not None:
            return len(self._counter.encode(text, add_special_tokens=False).ids)
        ids = self.model.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return len(ids)

    def encode(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        """Embeddings of `texts`: float32 [len(texts), dim], each row of unit L2 norm."""
        if isinstance(texts, str):
            raise ValueError("encode takes a sequence of texts; use encode_query for one text")
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            show_progress_bar=show_progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_query(self, text: str) -> np.ndarray:
        """The embedding of one query: float32 [dim], unit L2 norm (read-only: it may be a
        cached vector that later calls return too)."""
        if not text.strip():
            raise ValueError("the query is empty")
        with self._lock:
            vector = self._queries.get(text)
            if vector is not None:
                self._queries.move_to_end(text)
                return vector
        vector = self.encode([text])[0]
        vector.flags.writeable = False
        if self.cache_queries:
            with self._lock:
                self._queries[text] = vector
                while len(self._queries) > self.cache_queries:
                    self._queries.popitem(last=False)
        return vector


def _untruncated_copy(tokenizer: object) -> Any:
    """A private copy of the Rust tokenizer without truncation, or None for slow tokenizers."""
    # NOTE: the shared backend tokenizer truncates (to 128 for MiniLM) and encode() resets it per
    # call, so counting on it would undercount long text; a copy keeps counting exact and cheap.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    counter = Tokenizer.from_str(backend.to_str())
    counter.no_truncation()
    counter.no_padding()
    return counter
