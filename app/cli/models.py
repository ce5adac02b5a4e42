"""`prefixrag models fetch`: put every configured model on this machine ahead of time, so the
service can start later with no network (the packaged models need nothing)."""

from __future__ import annotations

import argparse
from typing import Any

from prefixrag.app.core.settings import Settings
from prefixrag.app.services.gguf_hub import ModelFetchError, fetch_gguf, parse_hub_gguf
from prefixrag.retrieval.model_hub import ModelNotInstalledError, fetch, looks_like_path

Subparsers = Any  # argparse's _SubParsersAction is private


def register_models(subparsers: Subparsers) -> None:
    """`models fetch`: download every configured hub model into the local cache (the LLM as a
    hub GGUF reference, org/repo[:QUANT] or org/repo/file.gguf)."""
    parser = subparsers.add_parser("models", help="the models the service uses")
    actions = parser.add_subparsers(dest="models_action", required=True)
    fetch_parser = actions.add_parser(
        "fetch", help="download every configured model from the hub into the local cache"
    )
    fetch_parser.set_defaults(handler=_fetch)


def configured_models(settings: Settings) -> list[tuple[str, str]]:
    """(role, name or path) for each model; an empty name stands for the packaged default."""
    return [
        ("llm", settings.llm),
        ("embedder", settings.embed_model),
        ("reranker", settings.rerank_model),
    ]


def _fetch_llm(name: str) -> bool:
    """Fetch the hub GGUF ``name`` (the hub is asked even when a copy is cached, so a newer
    upload replaces it); False after printing why not."""
    try:
        ref = parse_hub_gguf(name)
        if ref is None:
            print(f"llm: {name} is not a local path nor a hub GGUF (org/repo[:QUANT])")
            return False
        print(f"llm: fetching {ref}")
        print(f"llm: {ref} is in {fetch_gguf(ref)}")
    except ModelFetchError as exc:
        print(f"llm: not fetched: {exc}")
        return False
    return True


def _fetch(args: argparse.Namespace, settings: Settings) -> int:
    num_failed = 0
    for role, name in configured_models(settings):
        if not name:
            print(f"{role}: packaged with prefixrag, nothing to fetch")
        elif looks_like_path(name):
            print(f"{role}: local path {name}, nothing to fetch")
        elif role == "llm":
            num_failed += not _fetch_llm(name)
        else:
            print(f"{role}: fetching {name}")
            try:
                print(f"{role}: {name} is in {fetch(name)}")
            except ModelNotInstalledError as exc:
                print(f"{role}: not fetched: {exc}")
                num_failed += 1
    return 1 if num_failed else 0
