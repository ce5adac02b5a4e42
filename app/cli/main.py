"""The `prefixrag` command line. Each command is a `register(subparsers)` function in COMMANDS;
a feature adds its own by appending one."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixrag.app.cli.ask import register_ask
from prefixrag.app.cli.keys import register_keys
from prefixrag.app.cli.models import register_models
from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.core.settings import Settings, get_settings

if TYPE_CHECKING:
    from prefixrag.app.state import AppState

Subparsers = Any  # argparse's _SubParsersAction is private
Registrar = Callable[[Subparsers], None]

INGESTIBLE_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".html", ".htm", ".pdf"})


def register_serve(subparsers: Subparsers) -> None:
    """`serve --host H --port P [--replicas N]`: migrate the database, then serve the API with
    uvicorn (N > 1: on N engine replicas on Ray Serve)."""
    parser = subparsers.add_parser("serve", help="migrate the database and serve the API")
    parser.add_argument("--host", default=None, help="default: PREFIXRAG_HOST or 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: PREFIXRAG_PORT or 8000")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engine replicas; more than 1 runs them on Ray Serve (pip install prefixrag[ray]); "
        "default: PREFIXRAG_REPLICAS or 1",
    )
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    import importlib.util
    import os

    import uvicorn

    from prefixrag.app.core.db import upgrade_db

    replicas = settings.replicas if args.replicas is None else args.replicas
    if replicas < 1:
        print("--replicas must be at least 1", file=sys.stderr)
        return 2
    if replicas > 1 and importlib.util.find_spec("ray") is None:
        print("--replicas > 1 needs Ray: pip install 'prefixrag[ray]'", file=sys.stderr)
        return 2
    # the app factory reads its settings from the environment
    os.environ["PREFIXRAG_REPLICAS"] = str(replicas)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_db(settings.resolved_database_url)
    uvicorn.run(
        "prefixrag.app.main:create_app",
        factory=True,
        host=args.host or settings.host,
        port=args.port or settings.port,
    )
    return 0


def register_db(subparsers: Subparsers) -> None:
    """`db upgrade [REV]` and `db downgrade REV`: run the Alembic migrations."""
    parser = subparsers.add_parser("db", help="database migrations")
    actions = parser.add_subparsers(dest="db_action", required=True)
    upgrade = actions.add_parser("upgrade", help="apply migrations (default: up to head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(handler=_db_upgrade)
    downgrade = actions.add_parser("downgrade", help="revert migrations down to REVISION")
    downgrade.add_argument("revision")
    downgrade.set_defaults(handler=_db_downgrade)


def _db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.core.db import upgrade_db

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_db(settings.resolved_database_url, args.revision)
    print(f"database upgraded to {args.revision}")
    return 0


def _db_downgrade(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.core.db import downgrade_db

    downgrade_db(settings.resolved_database_url, args.revision)
    print(f"database downgraded to {args.revision}")
    return 0


def register_ingest(subparsers: Subparsers) -> None:
    """`ingest PATH... [--collection C] [--title T]`: ingest files and folders (recursive)."""
    parser = subparsers.add_parser("ingest", help="ingest files and folders (recursively)")
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--collection", default="default")
    parser.add_argument("--title", default=None, help="title for every file (default: its own)")
    parser.add_argument(
        "--tenant", default="default", help="the API key name that owns them (default: default)"
    )
    parser.set_defaults(handler=_ingest)


def _ingest(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.cli.ingest import ingest_files

    files = list(collect_files(args.paths))
    if not files:
        print("no ingestible files found")
        return 1
    report = ingest_files(
        settings, files, collection=args.collection, title=args.title, tenant=args.tenant
    )
    print(report.summary())
    return 1 if report.num_failed else 0


def collect_files(paths: Sequence[Path]) -> Iterator[Path]:
    """Named files as given, plus every file of a supported type under named folders, sorted."""
    for path in paths:
        if path.is_dir():
            found = (p for p in path.rglob("*") if p.is_file())
            yield from sorted(p for p in found if p.suffix.lower() in INGESTIBLE_SUFFIXES)
        else:
            yield path


def register_index(subparsers: Subparsers) -> None:
    """`index rebuild`: re-embed every ready chunk into a fresh vector index (and analyze them
    into a fresh tantivy BM25 index, when settings.lexical_engine asks for one)."""
    parser = subparsers.add_parser("index", help="vector index maintenance")
    actions = parser.add_subparsers(dest="index_action", required=True)
    rebuild = actions.add_parser(
        "rebuild", help="rebuild the vector index (and a tantivy BM25 index) from the database"
    )
    rebuild.set_defaults(handler=_index_rebuild)


def _index_rebuild(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.services.index_sync import rebuild_index
    from prefixrag.app.startup import default_loaders, open_index
    from prefixrag.app.state import AppState

    state = AppState(settings, loaders=default_loaders(settings))
    try:
        state.load_all({"db", "embedder"})
        state.require("db", "embedder")
        if state.sessions is None or state.embedder is None:
            return 1
        num_vectors = rebuild_index(
            sessions=state.sessions, index=open_index(state), embedder=state.embedder
        )
        print(f"rebuilt the vector index: {num_vectors} vectors")
        if settings.lexical_engine == "tantivy":
            num_chunks = _rebuild_tantivy(state)
            print(f"rebuilt the tantivy BM25 index: {num_chunks} chunks")
    finally:
        state.close()
    return 0


def _rebuild_tantivy(state: AppState) -> int:
    from prefixrag.app.services.index_sync import reconcile_lexical
    from prefixrag.app.services.lexical import TantivyLexicalIndex
    from prefixrag.retrieval.lexical.analyzer import Analyzer
    from prefixrag.retrieval.lexical.tantivy_index import TantivyLexical

    if state.sessions is None:
        raise NotReadyError("the database must load before the index")
    # a running server holds the index's writer lock: tantivy refuses, and nothing is touched
    store = TantivyLexical(state.settings.lexical_index_dir)
    try:
        store.reset()
        lexical = TantivyLexicalIndex(state.sessions, store, Analyzer())
        return reconcile_lexical(sessions=state.sessions, lexical=lexical).num_db_ids
    finally:
        store.close()


COMMANDS: tuple[Registrar, ...] = (
    register_serve,
    register_db,
    register_ingest,
    register_index,
    register_ask,
    register_keys,
    register_models,
)


def build_parser(commands: Sequence[Registrar] = COMMANDS) -> argparse.ArgumentParser:
    """The argument parser with one subcommand per registrar."""
    parser = argparse.ArgumentParser(prog="prefixrag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in commands:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    """Run one command; returns its exit code (errors in the input exit with 2)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.handler(args, settings or get_settings())
    except ValueError as exc:
        print(f"prefixrag {args.command}: {exc}")
        return 2
    return code
