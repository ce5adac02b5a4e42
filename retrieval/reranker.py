"""Cross-encoder reranking that degrades loudly, never fatally, when its model can't load."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixrag.retrieval.model_hub import (
    ModelNotInstalledError,
    fetch,
    is_offline,
    looks_like_path,
)

logger = logging.getLogger(__name__)

# What /readyz and the web page say when no cross-encoder is on this machine.
NOT_INSTALLED = (
    "reranker not installed: serving first-stage order; run `prefixrag models fetch` on a "
    "machine with internet, or set PREFIXRAG_RERANK_MODEL to a local path"
)


class Reranker:
    """A sentence-transformers CrossEncoder scoring (query, passage) pairs, higher = more relevant.

    The constructor never raises on a model that can't load: it logs a WARNING with the reason,
    sets `is_available` False and `status` to a plain sentence for people (`NOT_INSTALLED` when
    the model is not on this machine), and `score` returns None, so callers fall back to
    first-stage order.
    """

    def __init__(self, model_name_or_path: str, device: str | None = None) -> None:
        self.model_name_or_path = model_name_or_path
        self.is_available = False
        self.status = "unavailable: not loaded"
        self._model: Any = None
        try:
            self._model = _load_cross_encoder(model_name_or_path, device)
        except ModelNotInstalledError as exc:
            self.status = NOT_INSTALLED
            logger.warning("RERANKER NOT INSTALLED: %s; results keep first-stage order", exc)
            return
        except Exception as exc:  # NOTE: any load failure must leave the service serving
            # The status reaches people (/readyz, the web page): a plain sentence. The log keeps
            # the exception for whoever debugs it.
            reason = type(exc).__name__
            self.status = f"unavailable: the cross-encoder could not be loaded ({reason})"
            logger.warning(
                "RERANKER UNAVAILABLE: can't load cross-encoder %r; results keep the "
                "first-stage order",
                model_name_or_path,
                exc_info=True,
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
        # Raw logits: a sigmoid on top only squashes them, and in float32 it turns close
        # relevant passages into exact ties (sentence-transformers applies one by default).
        scores = self._model.predict(
            pairs, convert_to_numpy=True, show_progress_bar=False, activation_fn=_identity
        )
        scores = np.asarray(scores, dtype=np.float32)
        if scores.ndim == 2:  # a multi-label head: its last label is taken as "relevant"
            scores = scores[:, -1]
        return scores


def _identity(logits: Any) -> Any:
    return logits


def _load_cross_encoder(model_name_or_path: str, device: str | None) -> Any:
    """A local path loads as it is; a hub id loads from the local cache, fetched into it first
    when it is missing and the hub can be reached."""
    if not model_name_or_path:
        raise ModelNotInstalledError("no reranker model configured")
    from sentence_transformers import CrossEncoder

    if looks_like_path(model_name_or_path):
        if not os.path.isdir(os.path.expanduser(model_name_or_path)):
            raise ModelNotInstalledError(f"{model_name_or_path}: no such folder")
        return CrossEncoder(
            os.path.expanduser(model_name_or_path), device=device, local_files_only=True
        )
    try:
        return CrossEncoder(model_name_or_path, device=device, local_files_only=True)
    except OSError as exc:  # not in the cache
        if is_offline():
            raise ModelNotInstalledError(
                f"{model_name_or_path}: not in the local cache and the hub is switched off"
            ) from exc
    fetch(model_name_or_path)
    return CrossEncoder(model_name_or_path, device=device, local_files_only=True)
