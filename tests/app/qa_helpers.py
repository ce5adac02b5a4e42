"""Shared by the Q&A tests: settings with the LLM on a small KV pool, the converted weights of
the engine tests, three small documents, and an SSE parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixrag.app.cli.ask import iter_sse
from prefixrag.app.core.settings import Settings, packaged_embedder_path

DOCS = {
    "lighthouse.txt": (
        "The lighthouse keeper climbed the spiral stairs every evening to light the lamp.\n\n"
        "Ships far out at sea used the beam to avoid the rocky coast during storms.\n\n"
        "In the morning he wrote the weather and the passing ships into a leather logbook."
    ),
    "garden.md": (
        "# Gardening\n\nTomatoes need plenty of sun and regular watering through the summer.\n\n"
        "## Soil\n\nCompost and well-drained loam keep the roots healthy and free of rot.\n\n"
        "## Pests\n\nAphids can be washed off the leaves with a gentle spray of soapy water.\n"
    ),
    "volcano.txt": (
        "Magma rises through cracks in the crust of the earth and collects in chambers.\n\n"
        "Ash clouds from an eruption can ground aircraft for days across a whole continent."
    ),
}


def qa_settings(data_dir: Path, request: pytest.FixtureRequest, **overrides: Any) -> Settings:
    """LLM on, a 0.1 GB KV pool, small chunks; the GGUF conversion is shared with engine tests."""
    fields: dict[str, Any] = {
        "data_dir": data_dir,
        "embed_model": packaged_embedder_path(),
        "rerank_model": str(data_dir / "no-cross-encoder"),
        "chunk_tokens": 48,
        "chunk_overlap": 8,
        "kv_cache_gb": 0.1,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "index_use_gpu": "no",
        # these tests compare prompts with PromptBuilder.text, which knows no evidence: key
        # lines have tests of their own (test_evidence_spans.py)
        "answer_key_lines": 0,
    }
    fields.update(overrides)
    settings = Settings(**fields)
    cache = Path(request.config.cache.mkdir("prefixrag-engine-models"))
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    (settings.cache_dir / "models").symlink_to(cache, target_is_directory=True)
    return settings


def ingest_docs(client: httpx.Client, collection: str = "default") -> dict[str, int]:
    """Upload DOCS (waiting for each to be ready); returns document ids by file name."""
    ids = {}
    for name, text in DOCS.items():
        response = client.post(
            "/v1/documents?wait=true",
            files={"file": (name, text.encode(), "text/plain")},
            data={"collection": collection},
        )
        if response.status_code != 201 or response.json()["status"] != "ready":
            raise RuntimeError(f"ingesting {name} failed: {response.text}")
        ids[name] = response.json()["id"]
    return ids


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of a whole SSE body."""
    return list(iter_sse(iter(text.splitlines())))
