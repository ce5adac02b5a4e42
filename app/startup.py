"""Every component loader: database, embedder, vector index (with its start-up check),
reranker, LLM and the pinned prompt prefix. Each runs on the loader thread and fills in part of
the AppState; `default_loaders` lists them in dependency order. The index's reads of the corpus
need no embedder, so they run beside its load (`read_corpus`)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db
from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.core.settings import Settings
from prefixrag.app.prompt.builder import PromptBuilder, load_prompt_config
from prefixrag.app.services.llm import LLMService, engine_config_from_settings, model_id_for
from prefixrag.app.services.sentence_store import save_sentences
from prefixrag.app.state import AppState, ComponentLoader

if TYPE_CHECKING:
    import numpy as np

    from prefixrag.app.replicas.remote_engine import RemoteEngine
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.engine.config import EngineConfig
    from prefixrag.retrieval.lexical.analyzer import Analyzer
    from prefixrag.retrieval.lexical.terms import LexicalSearch
    from prefixrag.retrieval.pipeline import Retriever
    from prefixrag.retrieval.reranker import Reranker
    from prefixrag.retrieval.vector_index import VectorIndex

logger = logging.getLogger(__name__)


def default_loaders(settings: Settings) -> list[ComponentLoader]:
    """db, embedder, index (required) and reranker (optional), then, when the settings load an
    LLM, the llm (required) and the pinned prompt prefix (optional), in dependency order."""
    loaders = [
        ComponentLoader("db", load_db),
        ComponentLoader("embedder", load_embedder),
        ComponentLoader("index", load_index, prefetch=read_corpus, prefetch_needs=("db",)),
        ComponentLoader("reranker", load_reranker, required=False),
    ]
    if settings.load_llm:
        loaders.append(ComponentLoader("llm", load_llm))
        loaders.append(ComponentLoader("prompt_cache", load_prompt_cache, required=False))
    return loaders


def load_db(state: AppState) -> str | None:
    """Connect and migrate to the newest schema (a no-op when already there)."""
    url = state.settings.resolved_database_url
    state.settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_db(url)
    state.engine = make_engine(url)
    state.sessions = make_sessionmaker(state.engine)
    state.check_db()
    return None


def load_embedder(state: AppState) -> str | None:
    """Load the sentence-transformers embedder unless one was handed in."""
    if state.embedder is None:
        from prefixrag.retrieval.embedder import Embedder

        state.embedder = Embedder(state.settings.resolved_embed_model)
    return None


def _evidence_warmer(state: AppState) -> Callable[[list[int], list[str]], None] | None:
    """Embeds a new document's sentences for its evidence spans at ingest, where a question
    does not wait on it, and stores them (a restart does not embed them again)."""
    finder, embedder, sessions = state.evidence, state.embedder, state.sessions
    if finder is None or embedder is None or sessions is None:
        return None
    return lambda ids, texts: save_sentences(sessions, finder, embedder, ids, texts)


@dataclass(slots=True, frozen=True)
class SavedIndex:
    """The index file as read at start: the index (its dim the file's own), or None when there
    is no file or it cannot be read (`error` then says why)."""

    index: VectorIndex | None
    error: Exception | None = None


@dataclass(slots=True, frozen=True)
class CorpusRead:
    """What loading the index reads before it needs the embedder: the saved index and the ready
    chunk ids (sorted) of the database."""

    saved: SavedIndex
    db_ids: np.ndarray


def read_corpus(state: AppState) -> CorpusRead:
    """The index's prefetch (after the db): read the saved index and the ready chunk ids.

    Seconds each at a million chunks, spent mostly in FAISS and SQLite outside the GIL, so they
    overlap the embedder's load (mostly importing sentence-transformers) instead of following it.
    """
    from prefixrag.app.services.index_sync import ready_chunk_ids

    state.require("db")
    if state.sessions is None:
        raise NotReadyError("the database must load before the index")
    saved = read_saved_index(state.settings)
    with state.sessions() as session:
        db_ids = ready_chunk_ids(session=session)
    return CorpusRead(saved, db_ids)


def load_index(state: AppState) -> str | None:
    """Open the index, fail interrupted ingests, reconcile with the DB, start the ingest service.

    The prefetch (`read_corpus`) has read the index file and the ready ids meanwhile; a failure
    there fails this loader with the same error as when it ran here. BM25 searches the database
    (hybrid mode), which holds the terms with the rows: nothing lexical is built at start,
    whatever the corpus size.
    """
    from prefixrag.app.services.index_sync import fail_interrupted, reconcile_index
    from prefixrag.app.services.ingest import IngestService
    from prefixrag.app.services.lexical import DatabaseLexicalIndex
    from prefixrag.app.services.scopes import ScopeCache
    from prefixrag.retrieval.chunking import Chunker
    from prefixrag.retrieval.lexical.analyzer import Analyzer

    state.require("db", "embedder")
    if state.sessions is None or state.embedder is None:
        raise NotReadyError("the database and embedder must load before the index")
    read: CorpusRead = state.prefetched("index") or read_corpus(state)
    index = checked_index(state, read.saved)
    fail_interrupted(sessions=state.sessions)
    reconcile_index(
        sessions=state.sessions, index=index, embedder=state.embedder, db_ids=read.db_ids
    )
    settings = state.settings
    # one analyzer writes the terms and analyzes the queries
    analyzer = Analyzer()
    lexical: LexicalSearch | None = None
    if settings.retrieval_mode == "hybrid" and settings.lexical_engine == "tantivy":
        state.lexical_side = open_tantivy_lexical(state, analyzer, read.db_ids)
        lexical = state.lexical_side
    elif settings.retrieval_mode == "hybrid":
        lexical = DatabaseLexicalIndex(state.sessions, analyzer)
    chunker = Chunker(state.embedder.count_tokens, settings.chunk_tokens, settings.chunk_overlap)
    state.index = index
    state.scopes = ScopeCache()
    state.ingest = IngestService(
        state.sessions,
        state.embedder,
        index,
        chunker,
        scopes=state.scopes,
        max_upload_bytes=settings.max_upload_bytes,
        num_workers=settings.ingest_workers,
        queue_size=settings.ingest_queue_size,
        analyzer=analyzer,
        on_ready=_evidence_warmer(state),
        lexical_side=state.lexical_side,
    )
    # First-stage order until the reranker loader swaps in a reranking retriever.
    state.retriever = make_retriever(state, index, None, lexical)
    return None


def open_tantivy_lexical(
    state: AppState, analyzer: Analyzer, db_ids: np.ndarray
) -> TantivyLexicalIndex:
    """The tantivy BM25 index of the data dir, made to hold exactly the ready chunks (built from
    the rows when it is new, and repaired after a crash). A directory tantivy cannot open is
    set aside and rebuilt: it is derived data, and the rows still hold every term."""
    from prefixrag.app.services.index_sync import reconcile_lexical
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical

    if state.sessions is None:
        raise NotReadyError("the database must load before the index")
    path = state.settings.lexical_index_dir
    try:
        store = TantivyLexical(path)
    except ValueError as exc:  # tantivy's error for a directory it cannot read
        aside = path.with_name(f"{path.name}.unreadable")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        logger.warning("could not open %s (%s); moved it to %s and rebuilding", path, exc, aside)
        store = TantivyLexical(path)
    lexical = TantivyLexicalIndex(state.sessions, store, analyzer)
    reconcile_lexical(sessions=state.sessions, lexical=lexical, db_ids=db_ids)
    return lexical


def make_retriever(
    state: AppState, index: VectorIndex, reranker: Reranker | None, lexical: LexicalSearch | None
) -> Retriever:
    """The retriever the settings ask for: dense, or dense + BM25 fusion when `lexical` is set."""
    from prefixrag.retrieval.pipeline import Retriever

    if state.embedder is None:
        raise NotReadyError("the embedder must load before the retriever")
    return Retriever(
        state.embedder,
        index,
        reranker,
        lexical=lexical,
        lexical_weight=state.settings.hybrid_bm25_weight,
        rrf_k=state.settings.hybrid_rrf_k,
    )


def open_index(state: AppState) -> VectorIndex:
    """The persisted index, or a new empty one if none exists or it cannot be read; temp files
    of saves that a crash cut short are deleted first."""
    return checked_index(state, read_saved_index(state.settings))


def read_saved_index(settings: Settings) -> SavedIndex:
    """Delete the temp files of saves that a crash cut short, then read the index file, if any,
    with the dim it holds (no embedder needed). Never raises for a file it cannot read."""
    from prefixrag.retrieval.vector_index import VectorIndex, remove_partial_saves

    path = settings.index_path
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in remove_partial_saves(path):
        logger.warning("deleted %s, left by an index save that did not finish", leftover)
    if not path.exists():
        return SavedIndex(None)
    try:
        return SavedIndex(VectorIndex.open(path, None, **index_options(settings)))
    except Exception as exc:
        return SavedIndex(None, exc)


def checked_index(state: AppState, saved: SavedIndex) -> VectorIndex:
    """The saved index if it holds vectors of the embedder's dim, else a new empty one (the
    reconcile step that follows rebuilds it from the database)."""
    from prefixrag.retrieval.vector_index import VectorIndex

    if state.embedder is None:
        raise NotReadyError("the embedder must load before the index")
    dim = state.embedder.dim
    path = state.settings.index_path
    error = saved.error
    if saved.index is not None:
        try:
            saved.index.require_dim(dim)
            return saved.index
        except ValueError as exc:
            error = exc
    if error is not None:
        logger.error("cannot read the vector index at %s; starting a new one", path, exc_info=error)
    return VectorIndex(dim, path=path, **index_options(state.settings))


def index_options(settings: Settings) -> dict[str, Any]:
    """VectorIndex arguments for the settings. kind "auto" is an IVF index that stays flat
    (exact) until it holds index_ann_min_vectors, trains then, and adds to its lists after."""
    options: dict[str, Any] = {
        "kind": settings.index_kind,
        "nlist": settings.index_nlist,
        "nprobe": settings.index_nprobe,
        "use_gpu": settings.index_use_gpu,
    }
    if settings.index_kind == "auto":
        options["kind"] = "ivf"
        options["train_size"] = max(settings.index_ann_min_vectors, settings.index_nlist)
    return options


def load_reranker(state: AppState) -> str | None:
    """Load the cross-encoder; when it cannot load, say so loudly and keep first-stage order."""
    from prefixrag.retrieval.reranker import Reranker

    name = state.settings.rerank_model
    if state.reranker is None and name:
        state.reranker = Reranker(name)
    reranker = state.reranker
    status = "unavailable: no rerank_model configured" if reranker is None else reranker.status
    if status != "ok":
        logger.warning("RERANKER %s; search results keep first-stage (vector) order", status)
        reranker = None
    if state.embedder is not None and state.index is not None:
        lexical = state.retriever.lexical if state.retriever is not None else None
        state.retriever = make_retriever(state, state.index, reranker, lexical)
    return status


def load_llm(state: AppState) -> str | None:
    """Component loader: start the engine on the configured model (or say why not)."""
    from prefixrag.engine.async_engine import AsyncEngine

    settings = state.settings
    config = engine_config_from_settings(settings)
    engine: AsyncEngine | RemoteEngine
    if settings.replicas > 1:
        engine = start_remote_engine(settings, config)
    else:
        engine = AsyncEngine.from_config(config)
    state.llm = LLMService(
        engine, model_id_for(config.model), settings, state.metrics.observe_generation
    )
    logger.info(
        "llm: %s loaded, %d KV blocks of %d tokens, prefix cache %s",
        config.model,
        engine.num_kv_blocks,
        config.block_size,
        "on" if config.enable_prefix_cache else "off",
    )
    return None


def start_remote_engine(settings: Settings, config: EngineConfig) -> RemoteEngine:
    """Engine replicas on Ray Serve (settings.replicas of them), each pinning the stable prompt
    head as it starts; the ingress keeps only the tokenizer."""
    from prefixrag.app.replicas.remote_engine import RayConnection, RemoteEngine, start_replicas
    from prefixrag.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(config.model, cache_dir=config.cache_dir)
    pinned: list[int] = []
    if settings.prefix_cache:
        prompt_config = load_prompt_config(settings.system_prompt_file, settings.few_shot_file)
        pinned = PromptBuilder(tokenizer, prompt_config).stable_ids
    connection = RayConnection(settings.ray_address)
    try:
        handle = start_replicas(settings, config, pinned)
        engine = RemoteEngine(
            connection, handle, tokenizer, block_size=config.block_size, pinned_ids=pinned
        )
    except BaseException:
        connection.close()
        raise
    logger.info("llm: %d engine replicas on Ray Serve", settings.replicas)
    return engine


def load_prompt_cache(state: AppState) -> str | None:
    """Component loader (after "llm"): the prompt builder on the model's tokenizer, with the
    stable first part computed once and pinned so it is never evicted."""
    state.require("llm")
    if state.llm is None:
        raise NotReadyError("the LLM must load before the prompt cache")
    config = load_prompt_config(state.settings.system_prompt_file, state.settings.few_shot_file)
    builder = PromptBuilder(state.llm.engine.tokenizer, config)
    state.prompts = builder
    if not state.settings.prefix_cache:
        return "unavailable: prefix cache is off; the stable prompt is prefilled per request"
    num_pinned = asyncio.run(state.llm.engine.pin_prefix(builder.stable_ids))
    logger.info(
        "prompt_cache: stable prefix of %d tokens, %d pinned", len(builder.stable_ids), num_pinned
    )
    return None
