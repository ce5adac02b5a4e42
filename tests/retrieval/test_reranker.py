"""The Reranker loads a locally built cross-encoder by path, and degrades loudly when it can't."""

from __future__ import annotations

import logging
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import constants
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from prefixrag.retrieval.model_hub import hub_is_reachable
from prefixrag.retrieval.reranker import NOT_INSTALLED, Reranker
from tests.retrieval.tiny_cross_encoder import toy_pair


def reference_logits(model_dir: Path, query: str, texts: list[str]) -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    enc = tokenizer([query] * len(texts), texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits[:, 0].numpy()


def test_loads_by_path_and_orders_like_the_model(tiny_cross_encoder: Path) -> None:
    reranker = Reranker(str(tiny_cross_encoder), device="cpu")
    assert reranker.is_available and reranker.status == "ok"
    rng = random.Random(7)
    pairs = [toy_pair(rng) for _ in range(12)]
    query = pairs[0][0]
    texts = [passage for _, passage, _ in pairs]
    scores = reranker.score(query, texts)
    assert scores is not None and scores.shape == (12,) and scores.dtype == np.float32
    expected = reference_logits(tiny_cross_encoder, query, texts)
    np.testing.assert_array_equal(np.argsort(-scores), np.argsort(-expected))
    assert reranker.score(query, []).shape == (0,)


def test_trained_model_prefers_relevant_passages(tiny_cross_encoder: Path) -> None:
    reranker = Reranker(str(tiny_cross_encoder), device="cpu")
    rng = random.Random(11)
    pairs = [toy_pair(rng) for _ in range(64)]
    scores = reranker.score(pairs[0][0], [p for _, p, _ in pairs])
    labels = np.array([y for _, _, y in pairs])
    assert scores is not None
    assert scores[labels == 1].min() > scores[labels == 0].max()


def test_uncached_hub_name_offline_is_not_installed_at_once(caplog) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="prefixrag.retrieval.reranker"):
        reranker = Reranker("cross-encoder/this-model-is-not-cached-anywhere")
    assert time.monotonic() - start < 30  # generous: only guards against network retries
    assert not reranker.is_available
    assert reranker.status == NOT_INSTALLED
    assert reranker.score("q", ["a", "b"]) is None
    assert any("RERANKER NOT INSTALLED" in r.getMessage() for r in caplog.records)


def test_unreachable_hub_is_not_installed_without_retries(monkeypatch) -> None:
    # Online mode, but the hub's endpoint is a closed port on this machine.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert not hub_is_reachable()
    start = time.monotonic()
    reranker = Reranker("cross-encoder/this-model-is-not-cached-anywhere")
    assert time.monotonic() - start < 30  # huggingface_hub's own retries take about a minute
    assert reranker.status == NOT_INSTALLED


def test_missing_path_is_not_installed(tmp_path: Path) -> None:
    reranker = Reranker(str(tmp_path / "nothing-here"))
    assert not reranker.is_available and reranker.status == NOT_INSTALLED
    assert Reranker("").status == NOT_INSTALLED


def test_a_broken_model_folder_reads_as_a_sentence_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    reranker = Reranker(str(tmp_path))
    assert not reranker.is_available
    assert reranker.status.startswith("unavailable: the cross-encoder could not be loaded (")
    assert "\n" not in reranker.status and "http" not in reranker.status


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
