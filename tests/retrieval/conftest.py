"""Fixtures shared by the retrieval tests: the packaged embedder and a tiny local cross-encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder
from tests.retrieval.tiny_cross_encoder import build_tiny_cross_encoder


@pytest.fixture(scope="session")
def embedder_path() -> str:
    return packaged_embedder_path()


@pytest.fixture(scope="session")
def embedder(embedder_path: str) -> Embedder:
    return Embedder(embedder_path, device="cpu")


@pytest.fixture(scope="session")
def tiny_cross_encoder(embedder_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(embedder_path, tmp_path_factory.mktemp("cross_encoder"))
