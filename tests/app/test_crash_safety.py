"""Crash safety: `kill -9` the real server in the middle of an ingestion or a deletion, restart it
on the same data dir, and check that the database, its BM25 terms and the FAISS index file still
agree (and the tantivy BM25 index, when the server runs with lexical_engine "tantivy").

The invariants, checked on the stopped server's files (the reference is the database itself):
no document is left pending/processing; every ready document has chunk ordinals 0..n-1; a
failed document has a reason and no chunks; the index holds exactly the ready chunk ids; the
database holds BM25 terms for exactly the chunk rows; a tantivy index holds exactly the ready
chunk ids.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import select

from prefixrag.app.core.db import make_engine, make_sessionmaker
from prefixrag.app.core.models import Chunk, Document
from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.services.index_sync import reconcile_index
from prefixrag.app.services.lexical import DatabaseLexicalIndex
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.faiss_internals import faiss
from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical
from prefixrag.retrieval.vector_index import VectorIndex, remove_partial_saves
from tests.app.conftest import started
from tests.app.helpers import HTML, MARKDOWN, PLAIN_TEXT, chunk_ids
from tests.app.helpers import upload as upload_in_process
from tests.app.live_server import free_port

READY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
SMALL_DOCS = {"lighthouse.txt": PLAIN_TEXT, "garden.md": MARKDOWN, "volcano.html": HTML}
# About 2 chunks of 48 tokens per paragraph: the queued uploads take seconds to chunk and embed,
# the deleted one (ingested first) only a few.
QUEUED_DOC_PARAGRAPHS = 300
DELETED_DOC_PARAGRAPHS = 80
WORDS = (
    "river",
    "stone",
    "copper",
    "lantern",
    "orchard",
    "harbor",
    "meadow",
    "signal",
    "winter",
    "falcon",
    "granite",
    "compass",
    "ledger",
    "thunder",
    "velvet",
    "prism",
    "cedar",
    "beacon",
)


class ServerProcess:
    """`prefixrag serve` as a real subprocess on a free port, its log in `log_path`."""

    def __init__(
        self, data_dir: Path, database_url: str, log_path: Path, lexical_engine: str = "database"
    ) -> None:
        self.data_dir = data_dir
        self.database_url = database_url
        self.log_path = log_path
        self.lexical_engine = lexical_engine
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> httpx.Client:
        """Spawn the server and return a client once /readyz answers 200."""
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PREFIXRAG_DATA_DIR": str(self.data_dir),
            "PREFIXRAG_DATABASE_URL": self.database_url,
            "PREFIXRAG_LOAD_LLM": "0",
            "PREFIXRAG_EMBED_MODEL": packaged_embedder_path(),
            "PREFIXRAG_RERANK_MODEL": str(self.data_dir / "no-such-cross-encoder"),
            "PREFIXRAG_INDEX_USE_GPU": "no",
            "PREFIXRAG_CHUNK_TOKENS": "48",
            "PREFIXRAG_CHUNK_OVERLAP": "8",
            "PREFIXRAG_LEXICAL_ENGINE": self.lexical_engine,
        }
        command = [_prefixrag(), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        self._wait_ready()
        return httpx.Client(base_url=self.base, timeout=REQUEST_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook, no flush, no lifespan exit."""
        proc = self._require()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)

    def stop(self) -> None:
        """A graceful stop (SIGTERM) if it runs; escalates to SIGKILL if it hangs."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)

    def log_tail(self) -> str:
        """The last lines of the server log, for failure messages."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def _require(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("the server was never started")
        return self._proc

    def _wait_ready(self) -> None:
        proc = self._require()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            # NOTE: polling the readiness endpoint, which is the contract, not hiding a race.
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server never became ready:\n{self.log_tail()}")


def _prefixrag() -> str:
    script = Path(sys.executable).parent / "prefixrag"
    if not script.exists():
        raise RuntimeError(f"the prefixrag console script is not installed beside {sys.executable}")
    return str(script)


@dataclass(slots=True)
class StoreState:
    """What the database and the index file hold once the server has stopped."""

    statuses: dict[int, str]
    errors: dict[int, str | None]
    ordinals: dict[int, list[int]]
    chunk_ids: dict[int, set[int]]
    index_ids: set[int]
    lexical_ids: set[int]
    tantivy_ids: set[int] | None  # None: the server ran without one
    partial_saves: list[Path]

    def ready_chunk_ids(self) -> set[int]:
        """Chunk ids of every ready document."""
        ready = (ids for doc, ids in self.chunk_ids.items() if self.statuses[doc] == "ready")
        return set().union(*ready)


def read_store(data_dir: Path, database_url: str) -> StoreState:
    """Read documents, chunks, the saved FAISS index and any tantivy index straight from disk."""
    index_path = Settings(data_dir=data_dir).index_path
    tantivy_dir = Settings(data_dir=data_dir).lexical_index_dir
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            docs = conn.execute(select(Document.id, Document.status, Document.error)).all()
            chunks = conn.execute(
                select(Chunk.document_id, Chunk.id, Chunk.ordinal).order_by(Chunk.ordinal)
            ).all()
        lexical_ids = set(DatabaseLexicalIndex(make_sessionmaker(engine)).ids().tolist())
    finally:
        engine.dispose()
    state = StoreState(
        statuses={d.id: d.status for d in docs},
        errors={d.id: d.error for d in docs},
        ordinals={d.id: [] for d in docs},
        chunk_ids={d.id: set() for d in docs},
        index_ids=saved_index_ids(index_path),
        lexical_ids=lexical_ids,
        tantivy_ids=saved_tantivy_ids(tantivy_dir) if tantivy_dir.exists() else None,
        partial_saves=sorted(index_path.parent.glob(".*")),
    )
    for document_id, chunk_id, ordinal in chunks:
        state.ordinals[document_id].append(ordinal)
        state.chunk_ids[document_id].add(chunk_id)
    return state


def saved_index_ids(path: Path) -> set[int]:
    """The ids in the index file at `path` (empty when there is no file)."""
    if not path.exists():
        return set()
    dim = faiss.read_index(str(path)).d
    return {int(i) for i in VectorIndex.open(path, dim, use_gpu="no").ids()}


def saved_tantivy_ids(path: Path) -> set[int]:
    # read-only: the server may be running, holding the writer's lock
    return set(TantivyLexical(path, writable=False).ids().tolist())


def assert_consistent(store: StoreState) -> None:
    """The crash-safety invariants that must hold after any restart."""
    for doc, status in store.statuses.items():
        assert status in ("ready", "failed"), f"document {doc} is still {status}"
        if status == "ready":
            assert store.ordinals[doc] == list(range(len(store.ordinals[doc])))
            assert store.ordinals[doc], f"ready document {doc} has no chunks"
        else:
            assert store.errors[doc], f"failed document {doc} has no reason"
            assert not store.chunk_ids[doc], f"failed document {doc} still holds chunks"
    assert store.index_ids == store.ready_chunk_ids()
    # the BM25 terms live with the rows: exactly one per chunk row, whatever the crash
    assert store.lexical_ids == set().union(*store.chunk_ids.values())
    if store.tantivy_ids is not None:
        assert store.tantivy_ids == store.ready_chunk_ids()
    assert store.partial_saves == [], "temp files of unfinished index saves were left behind"


def big_text(seed: int, num_paragraphs: int) -> str:
    """A long plain-text document of distinct paragraphs (deterministic for a seed)."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(num_paragraphs):
        words = " ".join(rng.choice(WORDS) for _ in range(60))
        paragraphs.append(f"Record {seed}-{i}: {words}.")
    return "\n\n".join(paragraphs)


def upload(client: httpx.Client, name: str, text: str, *, wait: bool) -> dict:
    """POST one file; returns the response body (201 when waited for, else 202)."""
    url = "/v1/documents?wait=true" if wait else "/v1/documents"
    response = client.post(url, files={"file": (name, text.encode(), "application/octet-stream")})
    assert response.status_code == (201 if wait else 202), response.text
    body: dict = response.json()
    return body


def upload_small_docs(client: httpx.Client) -> dict[str, dict]:
    """Ingest the small documents to completion; returns each one's body by file name."""
    bodies = {}
    for name, text in SMALL_DOCS.items():
        body = upload(client, name, text, wait=True)
        assert body["status"] == "ready", body
        bodies[name] = body
    return bodies


def assert_earlier_docs_survived(client: httpx.Client, small: dict[str, dict]) -> None:
    """Documents that were ready before the kill are ready, whole, and searchable."""
    for body in small.values():
        doc = client.get(f"/v1/documents/{body['id']}").json()
        assert (doc["status"], doc["num_chunks"]) == ("ready", body["num_chunks"])
    hits = client.post("/v1/search", json={"query": "aphids soapy water", "top_k": 3}).json()
    assert hits["results"][0]["document_id"] == small["garden.md"]["id"]


def assert_same_chunks(before: StoreState, after: StoreState, small: dict[str, dict]) -> None:
    """The small documents kept exactly the chunk rows and vectors they had before the kill."""
    for body in small.values():
        doc = body["id"]
        assert after.chunk_ids[doc] == before.chunk_ids[doc] <= after.index_ids


@pytest.fixture(params=["database", "tantivy"])
def server(
    tmp_path: Path, database_url: str, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """A server process on a fresh data dir and database, with each lexical engine; stopped
    after the test."""
    proc = ServerProcess(tmp_path / "data", database_url, tmp_path / "server.log", request.param)
    yield proc
    proc.stop()


def test_kill_during_ingestion_loses_nothing_that_was_ready(server: ServerProcess) -> None:
    with server.start() as client:
        small = upload_small_docs(client)
        before = read_store(server.data_dir, server.database_url)
        big_ids = [
            upload(client, f"big{s}.txt", big_text(s, QUEUED_DOC_PARAGRAPHS), wait=False)[
                "document_id"
            ]
            for s in (1, 2, 3)
        ]
        seen = kill_when_processing(server, client, big_ids)
    assert seen == "processing", f"no upload was caught processing (last seen: {seen})"
    with server.start() as client:
        assert_earlier_docs_survived(client, small)
        for doc_id in big_ids:
            doc = client.get(f"/v1/documents/{doc_id}").json()
            assert doc["status"] in ("ready", "failed"), doc
            assert doc["status"] == "ready" or doc["error"], doc
    server.stop()
    store = read_store(server.data_dir, server.database_url)
    assert_consistent(store)
    assert_same_chunks(before, store, small)


def kill_when_processing(server: ServerProcess, client: httpx.Client, doc_ids: list[int]) -> str:
    """Poll the documents tightly and SIGKILL the server on first sight of `processing`;
    returns the status that triggered the kill ("ready"/"failed" if all finished first)."""
    while True:
        statuses = [client.get(f"/v1/documents/{d}").json()["status"] for d in doc_ids]
        if "processing" in statuses or all(s in ("ready", "failed") for s in statuses):
            server.kill()
            return "processing" if "processing" in statuses else statuses[-1]


def test_kill_during_deletion_leaves_the_document_whole_or_gone(server: ServerProcess) -> None:
    with server.start() as client:
        small = upload_small_docs(client)
        big = upload(client, "big.txt", big_text(7, DELETED_DOC_PARAGRAPHS), wait=True)
        assert big["status"] == "ready", big
        before = read_store(server.data_dir, server.database_url)
        deleting = threading.Thread(target=_delete_ignoring_the_kill, args=(server.base, big["id"]))
        deleting.start()
        kill_when_gone(server, client, big["id"], deleting)
        deleting.join(timeout=REQUEST_TIMEOUT_S)
    with server.start() as client:
        assert_earlier_docs_survived(client, small)
        response = client.get(f"/v1/documents/{big['id']}")
        assert response.status_code in (200, 404)
        if response.status_code == 200:
            assert (response.json()["status"], response.json()["num_chunks"]) == (
                "ready",
                big["num_chunks"],
            )
    server.stop()
    store = read_store(server.data_dir, server.database_url)
    assert_consistent(store)
    assert_same_chunks(before, store, small)
    big_chunks = before.chunk_ids[big["id"]]
    if big["id"] in store.statuses:
        assert store.chunk_ids[big["id"]] == big_chunks <= store.index_ids
    else:
        assert not big_chunks & store.index_ids
        assert not big_chunks & store.ready_chunk_ids()


def _delete_ignoring_the_kill(base: str, document_id: int) -> None:
    # the server is killed under the request: that is the point
    with contextlib.suppress(httpx.TransportError):
        httpx.delete(f"{base}/v1/documents/{document_id}", timeout=REQUEST_TIMEOUT_S)


def kill_when_gone(
    server: ServerProcess, client: httpx.Client, document_id: int, deleting: threading.Thread
) -> None:
    """SIGKILL the server the moment the document's row is gone (its vectors may not be yet),
    or once the DELETE has answered without removing it."""
    while client.get(f"/v1/documents/{document_id}").status_code != 404:
        if not deleting.is_alive():
            break
    server.kill()


def test_reconcile_drops_orphans_and_embeds_only_what_is_missing(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, embedder) as client:
        kept = upload_in_process(client, "a.txt", PLAIN_TEXT.encode()).json()
        lost = upload_in_process(client, "b.md", MARKDOWN.encode()).json()
        kept_ids = np.asarray(sorted(chunk_ids(client, kept["id"])), np.int64)
        lost_ids = np.asarray(sorted(chunk_ids(client, lost["id"])), np.int64)
    # The state a crash leaves: vectors of a deleted chunk, ready chunks without vectors.
    index = VectorIndex.open(settings.index_path, embedder.dim, use_gpu="no")
    index.remove(lost_ids)
    index.add(np.asarray([10**9], np.int64), embedder.encode(["a chunk whose row is gone"]))
    # A marker vector no embedding would produce shows that kept vectors are not re-embedded.
    marker = np.zeros((1, embedder.dim), np.float32)
    marker[0, 0] = 1.0
    index.remove(kept_ids[:1])
    index.add(kept_ids[:1], marker)
    kept_vectors = index.reconstruct(kept_ids)
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    try:
        report = reconcile_index(sessions=sessions, index=index, embedder=embedder)
        assert (report.num_orphan_vectors, report.num_missing_vectors) == (1, len(lost_ids))
        assert report.repaired
        saved = VectorIndex.open(settings.index_path, embedder.dim, use_gpu="no")
        assert sorted(saved.ids().tolist()) == sorted([*kept_ids.tolist(), *lost_ids.tolist()])
        with sessions() as session:
            texts = [session.get(Chunk, int(i)).text for i in lost_ids]  # type: ignore[union-attr]
        np.testing.assert_allclose(saved.reconstruct(lost_ids), embedder.encode(texts), atol=1e-5)
        np.testing.assert_array_equal(saved.reconstruct(kept_ids), kept_vectors)
        again = reconcile_index(sessions=sessions, index=saved, embedder=embedder)
        assert again.is_consistent and not again.repaired
    finally:
        engine.dispose()


def test_remove_partial_saves_deletes_only_the_index_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "index" / "chunks.faiss"
    index = VectorIndex(4, path=path, use_gpu="no")
    index.add(np.asarray([3, 5], np.int64), np.eye(4, dtype=np.float32)[:2])
    index.save()
    leftovers = [path.parent / ".chunks.faiss.k1ll3d", path.parent / ".chunks.faiss.x9"]
    others = [path.parent / ".other.faiss.k1ll3d", path.parent / "chunks.faiss.bak"]
    for extra in leftovers + others:
        extra.write_bytes(b"partial")
    assert remove_partial_saves(path) == sorted(leftovers)
    assert sorted(path.parent.iterdir()) == sorted([path, *others])
    assert sorted(VectorIndex.open(path, 4, use_gpu="no").ids().tolist()) == [3, 5]
    assert remove_partial_saves(tmp_path / "nowhere" / "chunks.faiss") == []
