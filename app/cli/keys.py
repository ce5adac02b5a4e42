"""`prefixrag keys create|list|revoke`: manage API keys (each key is a tenant)."""

from __future__ import annotations

import argparse
from typing import Any

from prefixrag.app.core.settings import Settings
from prefixrag.app.services.api_keys import KeyInfo


def register_keys(subparsers: Any) -> None:
    """`keys create --name N`, `keys list [--all]`, `keys revoke NAME`."""
    parser = subparsers.add_parser("keys", help="manage API keys (each key is a tenant)")
    actions = parser.add_subparsers(dest="keys_action", required=True)
    create = actions.add_parser("create", help="create a key and print it (only this once)")
    create.add_argument("--name", required=True, help="the tenant the key acts for")
    create.set_defaults(handler=_create)
    listing = actions.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    listing.set_defaults(handler=_list)
    revoke = actions.add_parser("revoke", help="revoke a key now")
    revoke.add_argument("name")
    revoke.set_defaults(handler=_revoke)


def _create(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.services.api_keys import create_key

    info, key = create_key(sessions=_sessions(settings), name=args.name)
    print(key)
    print(
        f"created key {info.key_prefix}... for tenant {info.tenant!r}; it is shown only now, "
        "store it safely. Every request now needs 'Authorization: Bearer <key>'.",
        file=_stderr(),
    )
    return 0


def _list(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.services.api_keys import list_keys

    keys = list_keys(sessions=_sessions(settings), include_revoked=args.all)
    if not keys:
        print("no keys: the API is open to anyone who can reach it")
        return 0
    print(f"{'NAME':<24} {'KEY':<16} {'CREATED':<20} STATUS")
    for info in keys:
        print(_row(info))
    return 0


def _revoke(args: argparse.Namespace, settings: Settings) -> int:
    from prefixrag.app.services.api_keys import revoke_key

    info = revoke_key(sessions=_sessions(settings), name=args.name)
    print(f"revoked key {info.key_prefix}... of {info.name!r}")
    return 0


def _row(info: KeyInfo) -> str:
    status = "active" if info.active else f"revoked {info.revoked_at:%Y-%m-%d %H:%M}"
    created = f"{info.created_at:%Y-%m-%d %H:%M}"
    return f"{info.name:<24} {info.key_prefix + '...':<16} {created:<20} {status}"


def _sessions(settings: Settings) -> Any:
    import logging

    from prefixrag.app.core.db import make_engine, make_sessionmaker, upgrade_db

    logging.getLogger("alembic").setLevel(logging.WARNING)  # keep the key the only output line

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_db(settings.resolved_database_url)
    return make_sessionmaker(make_engine(settings.resolved_database_url))


def _stderr() -> Any:
    import sys

    return sys.stderr
