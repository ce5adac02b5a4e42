"""Sentence embeddings (sentence-transformers) and the matching token counter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class Embedder:
    """A sentence-transformers bi-encoder that returns L2-normalized float32 vectors.

    `count_tokens` uses the model's own tokenizer, so chunk sizes match what the model sees;
    `max_seq_length` is how many tokens the model reads before truncating.
    """

    def __init__(
        self, model_name_or_path: str, device: str | None = None, batch_size: int = 64
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
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
        """The embedding of one query: float32 [dim], unit L2 norm."""
        if not text.strip():
            raise ValueError("the query is empty")
        return self.encode([text])[0]


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
