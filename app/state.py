"""Everything the service holds while it runs, and the background loading that fills it in.

Each component (db, embedder, index, reranker, and whatever others register) has a status in
`components`: "loading", "ok", "unavailable: <why>" or "error: <why>". Loaders run in order on
one background thread, so the process answers /healthz at once while models load. A loader's
`prefetch` (work that needs fewer components than its `load`) runs on a thread of its own beside
the loaders before it, once the components it names in `prefetch_needs` are "ok".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.metrics import Metrics
from prefixrag.app.services.qa import QAPipeline
from prefixrag.retrieval.evidence import EvidenceFinder

if TYPE_CHECKING:
    from prefixrag.app.prompt.builder import PromptBuilder
    from prefixrag.app.services.ingest import IngestService
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.app.services.llm import LLMService
    from prefixrag.app.services.scopes import ScopeCache
    from prefixrag.retrieval.embedder import Embedder
    from prefixrag.retrieval.pipeline import Retriever
    from prefixrag.retrieval.reranker import Reranker
    from prefixrag.retrieval.vector_index import VectorIndex

logger = logging.getLogger(__name__)

LOADING = "loading"
OK = "ok"


@dataclass(slots=True, frozen=True)
class ComponentLoader:
    """Loads one component into the state; `load` returns its status (None means "ok").

    A required component that is not "ok" keeps /readyz at 503; an optional one only reports.
    `prefetch`, when set, starts on its own thread as soon as every component in
    `prefetch_needs` is "ok", and `load` collects its result with `AppState.prefetched`.
    """

    name: str
    load: Callable[[AppState], str | None]
    required: bool = True
    prefetch: Callable[[AppState], Any] | None = None
    prefetch_needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a component loader needs a name")
        if self.prefetch_needs and self.prefetch is None:
            raise ValueError(f"loader {self.name!r} names prefetch_needs but has no prefetch")


class AppState:
    """Settings, DB, models, index and services of one running app, plus their readiness."""

    def __init__(
        self,
        settings: Settings,
        *,
        embedder: Embedder | None = None,
        reranker: Reranker | None = None,
        loaders: Sequence[ComponentLoader] = (),
    ) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.sessions: sessionmaker[Session] | None = None
        self.embedder = embedder
        self.reranker = reranker
        self.index: VectorIndex | None = None
        self.retriever: Retriever | None = None
        self.scopes: ScopeCache | None = None  # searches' allowed chunk ids, kept by ingest
        self.ingest: IngestService | None = None
        self.lexical_side: TantivyLexicalIndex | None = None  # settings.lexical_engine "tantivy"
        self.llm: LLMService | None = None
        self.prompts: PromptBuilder | None = None
        # held for the process: it caches each chunk's sentence vectors
        self.evidence = (
            EvidenceFinder(max_spans=settings.evidence_spans) if settings.evidence_spans else None
        )
        self.metrics = Metrics(llm=lambda: self.llm, sessions=lambda: self.sessions)
        self.components: dict[str, str] = {}
        self.loaders: list[ComponentLoader] = []
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefetches: dict[str, Future[Any]] = {}
        for loader in loaders:
            self.add_loader(loader)

    def add_loader(self, loader: ComponentLoader) -> None:
        """Register a component to load after those already registered (before start only)."""
        if self._thread is not None:
            raise RuntimeError("loaders must be added before loading starts")
        if any(existing.name == loader.name for existing in self.loaders):
            raise ValueError(f"a loader named {loader.name!r} is already registered")
        self.loaders.append(loader)
        self.set_status(loader.name, LOADING)

    def set_status(self, name: str, status: str) -> None:
        """Record a component's status (thread-safe)."""
        with self._lock:
            self.components[name] = status

    def status(self, name: str) -> str | None:
        """A component's status, or None if no such component."""
        with self._lock:
            return self.components.get(name)

    def snapshot(self) -> dict[str, str]:
        """A copy of every component's status."""
        with self._lock:
            return dict(self.components)

    def live_snapshot(self) -> dict[str, str]:
        """snapshot(), with a loaded database asked again now: a database that went away after
        start-up reads "unavailable: <why>" (its recorded status stays, for when it is back)."""
        states = self.snapshot()
        if states.get("db") == OK:
            try:
                self.check_db()
            except Exception as error:  # any driver's failure means the same to a caller
                states["db"] = f"unavailable: {type(error).__name__}"
        return states

    def ready_in(self, states: dict[str, str]) -> bool:
        """True when every required component is "ok" in `states` and none is still loading."""
        required = {loader.name for loader in self.loaders if loader.required}
        if any(state == LOADING for state in states.values()):
            return False
        return all(states.get(name) == OK for name in required)

    @property
    def is_ready(self) -> bool:
        """True once every required component is "ok" and none is still loading."""
        return self.ready_in(self.snapshot())

    def require(self, *names: str) -> None:
        """Raise NotReadyError unless each named component is "ok"."""
        for name in names:
            state = self.status(name)
            if state != OK:
                raise NotReadyError(f"{name} is not ready ({state or 'not configured'})")

    def start_loading(self) -> threading.Thread:
        """Run every loader on a background thread; returns that thread."""
        if self._thread is not None:
            raise RuntimeError("loading already started")
        self._thread = threading.Thread(target=self.load_all, name="prefixrag-loader", daemon=True)
        self._thread.start()
        return self._thread

    def load_all(self, names: set[str] | None = None) -> None:
        """Run the loaders (all, or those in `names`) in order, here and now, and the prefetches
        of those loaders beside them; returns once every prefetch it started has finished."""
        selected = [loader for loader in self.loaders if names is None or loader.name in names]
        try:
            self._start_prefetches(selected)
            for loader in selected:
                self._run_loader(loader)
                self._start_prefetches(selected)
        finally:
            # no prefetch outlives loading, even one whose loader failed before collecting it
            for future in self._prefetches.values():
                future.exception()
            self._loaded.set()

    def prefetched(self, name: str) -> Any | None:
        """The result of loader `name`'s prefetch, once it has finished (re-raising what it
        raised), or None when it was not started; the loader then does that work itself."""
        future = self._prefetches.get(name)
        return None if future is None else future.result()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until every loader has finished (whatever its outcome); False on timeout."""
        return self._loaded.wait(timeout)

    def qa_pipeline(self) -> QAPipeline:
        """The loaded Q&A pipeline; NotReadyError (503) while any part of it is loading."""
        self.require("db", "embedder", "index", "llm")
        if (
            self.sessions is None
            or self.retriever is None
            or self.scopes is None
            or self.llm is None
            or self.prompts is None
        ):
            raise NotReadyError("the Q&A pipeline is not ready (prompt builder not loaded)")
        return QAPipeline(
            sessions=self.sessions,
            retriever=self.retriever,
            scopes=self.scopes,
            llm=self.llm,
            prompts=self.prompts,
            settings=self.settings,
            on_retrieval=self.metrics.observe_retrieval,
            evidence=self.evidence,
        )

    def check_db(self) -> None:
        """Run a trivial query, raising if the database is unreachable."""
        if self.engine is None:
            raise NotReadyError("database is not connected")
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def close(self) -> None:
        """Stop ingest workers (queued jobs are dropped) and release the database."""
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.ingest is not None:
            self.ingest.close(wait=True, cancel_pending=True)
        if self.lexical_side is not None:
            self.lexical_side.store.close()  # its directory's writer lock, once merges end
        if self.llm is not None:
            self.llm.engine.shutdown()
        if self.engine is not None:
            self.engine.dispose()

    def _start_prefetches(self, selected: Sequence[ComponentLoader]) -> None:
        """Start the prefetch of each selected loader that has not run yet, once its needs are
        "ok" (a prefetch whose needs fail never starts: its loader reports why)."""
        for loader in selected:
            prefetch = loader.prefetch
            if prefetch is None or loader.name in self._prefetches:
                continue
            if self.status(loader.name) != LOADING:
                continue
            if all(self.status(need) == OK for need in loader.prefetch_needs):
                self._prefetches[loader.name] = _start_thread(
                    f"prefixrag-prefetch-{loader.name}", prefetch, self
                )

    def _run_loader(self, loader: ComponentLoader) -> None:
        try:
            status = loader.load(self) or OK
        except Exception as exc:
            logger.exception("loading %s failed", loader.name)
            status = f"error: {type(exc).__name__}: {exc}"
        self.set_status(loader.name, status)
        if status == OK:
            logger.info("%s: ok", loader.name)
        elif loader.required:
            logger.error("%s: %s", loader.name, status)


def _start_thread(name: str, fn: Callable[[AppState], Any], state: AppState) -> Future[Any]:
    """Run `fn(state)` on a new daemon thread; the future holds its result or its exception."""
    future: Future[Any] = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(state))
        except BaseException as exc:  # NOTE: handed to whoever collects the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
