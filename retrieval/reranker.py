"""Cross-encoder reranking that degrades loudly, never fatally, when its model can't load."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class Reranker:
    """A sentence-transformers CrossEncoder scoring (query, passage) pairs, higher = more relevant.

    The constructor never raises on a model that can't load: it logs a WARNING with the reason,
    sets `is_available` False and `status` to "unavailable: <reason>", and `score` returns None,
    so callers fall back to first-stage order.
    """

    def __init__(self, model_name_or_path: str, device: str | None = None) -> None:
        self.model_name_or_path = model_name_or_path
        self.is_available = False
        self.status = "unavailable: not loaded"
        self._model: Any = None
        try:
            self._model = _load_cross_encoder(model_name_or_path, device)
        except Exception as exc:  # NOTE: any load failure must leave the service serving
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            self.status = f"unavailable: {reason}"
            logger.warning(
                "RERANKER UNAVAILABLE: can't load cross-encoder %r (%s); results keep the "
                "first-stage (vector search) order",
                model_name_or_path,
                reason,
            )
            return
        self.is_available = True
        self.status = "ok"

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray | None:
        """One relevance score per text (float32 [len(texts)]), or None when unavailable."""
        if not self.is_available:
            return None
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        pairs = [(query, text) for text in texts]
        scores = self._model.predict(pairs, convert_to_numpy=True, show_progress_bar=False)
        scores = np.asarray(scores, dtype=np.float32)
        if scores.ndim == 2:  # a multi-label head: its last label is taken as "relevant"
            scores = scores[:, -1]
        return scores


def _load_cross_encoder(model_name_or_path: str, device: str | None) -> Any:
    if not model_name_or_path:
        raise ValueError("no reranker model configured")
    from sentence_transformers import CrossEncoder

    # With the hub offline, ask for cached files only, so a missing model fails at once
    # instead of waiting on network retries.
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    is_local = os.path.isdir(model_name_or_path)
    return CrossEncoder(model_name_or_path, device=device, local_files_only=offline or is_local)
