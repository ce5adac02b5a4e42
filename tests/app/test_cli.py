"""The `prefixrag` CLI: ingest a folder tree (reporting duplicates and failures) and rebuild
the index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefixrag.app.cli.main import main
from prefixrag.app.core.settings import Settings
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from prefixrag.retrieval.vector_index import VectorIndex
from tests.app.conftest import started
from tests.app.helpers import HTML, MARKDOWN, PLAIN_TEXT, chunk_ids, index_ids


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """Each command loads its own embedder (seconds), so these run on SQLite only; the DB
    code they call is tested on both databases elsewhere."""
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text(PLAIN_TEXT)
    (root / "nested" / "b.md").write_text(MARKDOWN)
    (root / "nested" / "deeper" / "c.html").write_text(HTML)
    (root / "nested" / "copy-of-a.txt").write_text(PLAIN_TEXT)  # same content: a duplicate
    (root / "nested" / "picture.png").write_bytes(b"\x89PNG")  # skipped inside folders
    return root


def test_ingest_walks_folders_and_reports_duplicates(
    tree: Path, settings: Settings, embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["db", "upgrade"], settings) == 0
    code = main(["ingest", str(tree), "--collection", "manuals"], settings)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ingested 3, duplicates 1, failed 0" in out
    assert "copy-of-a.txt" in out
    with started(settings, embedder) as client:
        docs = client.get("/v1/documents", params={"collection": "manuals"}).json()
        assert sorted(d["filename"] for d in docs["items"]) == ["a.txt", "b.md", "c.html"]
        assert all(d["status"] == "ready" for d in docs["items"])
        assert index_ids(client) == chunk_ids(client)


def test_ingest_exits_non_zero_when_a_file_fails(
    tree: Path, tmp_path: Path, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"%PDF-1.4 garbage")
    unsupported = tmp_path / "data.bin"
    unsupported.write_bytes(b"\x00\x01")
    code = main(["ingest", str(bad), str(unsupported), str(tree / "a.txt")], settings)
    out = capsys.readouterr().out
    assert code == 1
    assert "ingested 1, duplicates 0, failed 2" in out
    assert f"failed: {bad}" in out and f"failed: {unsupported}" in out


def test_index_rebuild_recreates_a_lost_index(
    tree: Path, settings: Settings, embedder: Embedder, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ingest", str(tree)], settings) == 0
    saved = VectorIndex.open(settings.index_path, embedder.dim, use_gpu="no")
    expected = {int(i) for i in saved.ids()}
    query = embedder.encode_query("ash clouds ground aircraft")[None, :]
    before_scores, before_ids = saved.search(query, 3)
    settings.index_path.unlink()
    assert main(["index", "rebuild"], settings) == 0
    assert f"{len(expected)} vectors" in capsys.readouterr().out
    rebuilt = VectorIndex.open(settings.index_path, embedder.dim, use_gpu="no")
    assert {int(i) for i in rebuilt.ids()} == expected
    after_scores, after_ids = rebuilt.search(query, 3)
    np.testing.assert_array_equal(after_ids, before_ids)
    np.testing.assert_allclose(after_scores, before_scores, atol=1e-5)


def test_index_rebuild_also_rebuilds_a_tantivy_index(
    tree: Path, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = settings.model_copy(update={"lexical_engine": "tantivy"})
    assert main(["ingest", str(tree)], settings) == 0
    store = TantivyLexical(settings.lexical_index_dir)
    expected = store.ids().tolist()
    assert expected  # ingest filled it
    before = store.search(["ash", "cloud"], 5)
    assert before[1].size
    store.add([10**9], [["ash"]], document_ids=[1], collection_ids=[1])  # a stale chunk
    store.close()
    assert main(["index", "rebuild"], settings) == 0
    assert f"rebuilt the tantivy BM25 index: {len(expected)} chunks" in capsys.readouterr().out
    store = TantivyLexical(settings.lexical_index_dir)
    assert store.ids().tolist() == expected
    after = store.search(["ash", "cloud"], 5)
    assert after[1].tolist() == before[1].tolist()
    store.close()


def test_serve_refuses_fewer_than_one_replica(tmp_path: Path, capsys) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    assert main(["serve", "--replicas", "0"], settings=settings) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
