"""`prefixrag ask "question"`: stream an answer from a running server's /v1/query, then list
the numbered sources."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from prefixrag.app.core.settings import Settings
from prefixrag.app.schemas.query import EvidenceOut

DEFAULT_TIMEOUT_S = 300.0


class AskError(RuntimeError):
    """The server could not be reached or answered with an error."""


def register_ask(subparsers: Any) -> None:
    """`ask QUESTION [--collection C] [--document ID]... [--url URL]`."""
    parser = subparsers.add_parser("ask", help="ask a running server a question")
    parser.add_argument("question")
    parser.add_argument("--collection", default=None)
    parser.add_argument(
        "--document", type=int, action="append", default=None, help="limit to a document id"
    )
    parser.add_argument("--url", default=None, help="default: http://PREFIXRAG_HOST:PREFIXRAG_PORT")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXRAG_API_KEY"),
        help="sent as a Bearer token (default: $PREFIXRAG_API_KEY)",
    )
    parser.set_defaults(handler=_ask)


def _ask(args: argparse.Namespace, settings: Settings) -> int:
    url = args.url or f"http://{settings.host}:{settings.port}"
    body: dict[str, Any] = {"question": args.question, "stream": True}
    if args.collection is not None:
        body["collection"] = args.collection
    if args.document:
        body["document_ids"] = args.document
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    try:
        ask(url, body, sys.stdout, api_key=args.api_key)
    except AskError as exc:
        print(f"prefixrag ask: {exc}", file=sys.stderr)
        return 1
    return 0


def ask(
    url: str, body: dict[str, Any], out: TextIO, *, api_key: str | None = None
) -> dict[str, Any]:
    """POST `body` to `url`/v1/query, print deltas to `out` as they arrive, then the sources;
    returns the `done` event's payload. Raises AskError on any failure."""
    endpoint = url.rstrip("/") + "/v1/query"
    headers = {} if not api_key else {"Authorization": f"Bearer {api_key}"}
    citations: list[dict[str, Any]] = []
    try:
        with httpx.stream(
            "POST", endpoint, json=body, headers=headers, timeout=DEFAULT_TIMEOUT_S
        ) as response:
            if response.status_code != 200:
                response.read()
                raise AskError(f"the server answered {response.status_code}: {_detail(response)}")
            for event, data in iter_sse(response.iter_lines()):
                if event == "citations":
                    citations = data["citations"]
                elif event == "delta":
                    out.write(data["text"])
                    out.flush()
                elif event == "error":
                    raise AskError(data.get("detail", "generation failed"))
                elif event == "done":
                    out.write("\n")
                    print_sources(citations, out)
                    return dict(data)
    except httpx.TransportError as exc:
        raise AskError(f"cannot reach the prefixrag server at {url}: {exc}") from exc
    raise AskError("the answer stream ended without a done event")


def print_sources(citations: list[dict[str, Any]], out: TextIO) -> None:
    """ "Sources:" then one "[n] title, page p" line per citation, each followed by its evidence
    spans as quoted, indented lines ("(no sources)" when there are none)."""
    if not citations:
        out.write("\n(no sources)\n")
        return
    out.write("\nSources:\n")
    for c in citations:
        page = "" if c.get("page") is None else f", page {c['page']}"
        out.write(f"[{c['n']}] {c['title']}{page}\n")
        for span in c.get("evidence", ()):
            out.write(f"    > {EvidenceOut(**span).one_line()}\n")


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, JSON data) for each server-sent event in a stream of lines."""
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        yield event, json.loads("\n".join(data))


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text
