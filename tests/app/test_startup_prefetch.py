"""Loader prefetches (work a loader starts on its own thread beside the loaders before it) and
the index's: the saved index and the ready ids read while the embedder loads."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from prefixrag.app.core.settings import Settings
from prefixrag.app.startup import default_loaders, load_db, load_index
from prefixrag.app.state import AppState, ComponentLoader
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.vector_index import VectorIndex
from tests.app.conftest import LOAD_TIMEOUT_S, app_state, started
from tests.app.helpers import MARKDOWN, PLAIN_TEXT, chunk_ids, index_ids, upload

WAIT_S = 60  # a guard against hanging, never a measurement


def _loaded(state: AppState, names: set[str] | None = None) -> dict[str, str]:
    """Run the loaders on their thread (as the app does) and return every status."""
    if names is None:
        state.start_loading()
    else:
        threading.Thread(target=state.load_all, args=(names,), daemon=True).start()
    assert state.wait_loaded(WAIT_S), "loading hung"
    return state.snapshot()


def test_a_prefetch_runs_beside_the_loader_before_it(settings: Settings) -> None:
    first_running, prefetch_running = threading.Event(), threading.Event()

    def slow_first(_: AppState) -> str | None:
        # each waits for the other to be running: only two threads at once get both through
        first_running.set()
        return None if prefetch_running.wait(WAIT_S) else "error: the prefetch never ran"

    def prefetch(_: AppState) -> int:
        prefetch_running.set()
        if not first_running.wait(WAIT_S):
            raise TimeoutError("the first loader never ran beside the prefetch")
        return 42

    def second(state: AppState) -> str | None:
        return None if state.prefetched("second") == 42 else "error: no prefetched result"

    state = AppState(
        settings,
        loaders=[
            ComponentLoader("first", slow_first),
            ComponentLoader("second", second, prefetch=prefetch),
        ],
    )
    assert _loaded(state) == {"first": "ok", "second": "ok"}


def test_a_failing_prefetch_fails_its_loader_with_its_own_error(settings: Settings) -> None:
    def prefetch(_: AppState) -> int:
        raise RuntimeError("disk on fire")

    def second(state: AppState) -> str | None:
        state.prefetched("second")
        return None

    state = AppState(
        settings,
        loaders=[
            ComponentLoader("first", lambda _: None),
            ComponentLoader("second", second, prefetch=prefetch, prefetch_needs=("first",)),
        ],
    )
    assert _loaded(state)["second"] == "error: RuntimeError: disk on fire"
    assert not state.is_ready


def test_a_prefetch_waits_for_its_needs_and_never_runs_without_them(settings: Settings) -> None:
    calls: list[str] = []

    def broken(_: AppState) -> str | None:
        raise RuntimeError("no database")

    def prefetch(_: AppState) -> None:
        calls.append("prefetch")

    def second(state: AppState) -> str | None:
        calls.append(f"load saw {state.prefetched('second')!r}")
        return None

    loaders = [
        ComponentLoader("first", broken),
        ComponentLoader("second", second, prefetch=prefetch, prefetch_needs=("first",)),
    ]
    assert _loaded(AppState(settings, loaders=loaders))["first"].startswith("error:")
    assert calls == ["load saw None"]
    # nor does it run for a loader left out of load_all (`index rebuild` loads db and embedder)
    calls.clear()
    ok_first = [ComponentLoader("first", lambda _: None), loaders[1]]
    assert _loaded(AppState(settings, loaders=ok_first), {"first"}) == {
        "first": "ok",
        "second": "loading",
    }
    assert calls == []
    with pytest.raises(ValueError, match="prefetch_needs"):
        ComponentLoader("third", second, prefetch_needs=("first",))


def test_the_index_reads_its_corpus_beside_the_embedder(
    settings: Settings, embedder: Embedder
) -> None:
    with started(settings, embedder) as client:
        upload(client, "a.txt", PLAIN_TEXT.encode())
        upload(client, "b.md", MARKDOWN.encode())
        expected = chunk_ids(client)
    state = AppState(settings, embedder=embedder, loaders=default_loaders(settings))
    try:
        assert _loaded(state, {"db", "index"}) == {
            "db": "ok",
            "embedder": "loading",  # not run: the embedder was handed in
            "index": "error: NotReadyError: embedder is not ready (loading)",
            "reranker": "loading",
        }
    finally:
        state.close()
    state = AppState(settings, embedder=embedder, loaders=default_loaders(settings))
    try:
        assert _loaded(state, {"db", "embedder", "index"})["index"] == "ok"
        assert state.index is not None and set(state.index.ids().tolist()) == expected
        assert state.ingest is not None  # the index loader finished its work after the join
    finally:
        state.close()


def test_a_failing_corpus_read_fails_start_up_as_it_did_without_the_prefetch(
    settings: Settings, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    def locked(**_: object) -> np.ndarray:
        raise RuntimeError("database is locked")

    monkeypatch.setattr("prefixrag.app.services.index_sync.ready_chunk_ids", locked)
    statuses = []
    for index_loader in (
        next(loader for loader in default_loaders(settings) if loader.name == "index"),
        ComponentLoader("index", load_index),  # everything on the loader thread, as before
    ):
        loaders = [ComponentLoader("db", load_db), ComponentLoader("embedder", lambda _: None)]
        state = AppState(settings, embedder=embedder, loaders=[*loaders, index_loader])
        try:
            statuses.append(_loaded(state)["index"])
        finally:
            state.close()
    assert statuses == ["error: RuntimeError: database is locked"] * 2


@pytest.mark.parametrize("damage", ["garbage", "other_dim"])
def test_an_unreadable_index_file_is_rebuilt_from_the_database(
    settings: Settings, embedder: Embedder, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    with started(settings, embedder) as client:
        upload(client, "a.txt", PLAIN_TEXT.encode())
        expected = chunk_ids(client)
    if damage == "garbage":
        settings.index_path.write_bytes(b"not a faiss index")
    else:
        other = VectorIndex(embedder.dim + 1, path=settings.index_path, use_gpu="no")
        other.add(np.asarray([10**9], np.int64), np.ones((1, embedder.dim + 1), np.float32))
        other.save()
    with caplog.at_level(logging.ERROR), started(settings, embedder) as client:
        assert app_state(client).wait_loaded(LOAD_TIMEOUT_S)
        assert client.get("/readyz").status_code == 200
        assert index_ids(client) == expected
    assert any("cannot read the vector index" in r.getMessage() for r in caplog.records)
