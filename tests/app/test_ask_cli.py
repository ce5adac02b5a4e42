"""`prefixrag ask` against a live server, and its error when no server listens."""

from __future__ import annotations

import re

import httpx
import pytest

from prefixrag.app.cli.main import main
from prefixrag.app.main import create_app
from tests.app.conftest import LOAD_TIMEOUT_S
from tests.app.live_server import free_port, live_server
from tests.app.qa_helpers import ingest_docs, qa_settings


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(tmp_path_factory.mktemp("ask-data"), request)
    app = create_app(settings, embedder=embedder)
    with (
        live_server(app, LOAD_TIMEOUT_S) as base,
        httpx.Client(base_url=base, timeout=LOAD_TIMEOUT_S) as http,
    ):
        yield base, http, ingest_docs(http)


def test_ask_prints_the_streamed_answer_then_numbered_sources(server, capsys):
    base, http, ids = server
    question = "What keeps the roots healthy?"
    args = [
        "ask",
        question,
        "--url",
        base,
        "--document",
        str(ids["garden.md"]),
        "--max-tokens",
        "8",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    expected = http.post(
        "/v1/query",
        json={"question": question, "document_ids": [ids["garden.md"]], "max_tokens": 8},
    ).json()
    answer, sources = printed.split("\n\nSources:\n")
    assert answer == expected["answer"]  # greedy: the same answer as the JSON route
    lines = sources.splitlines()
    assert len(expected["citations"]) > 0
    for cited in expected["citations"]:  # "[n] title", then one quoted line per evidence span
        line = lines.pop(0)
        assert re.fullmatch(rf"\[{cited['n']}\] {re.escape(cited['title'])}(, page \d+)?", line)
        assert cited["evidence"]
        for span in cited["evidence"]:
            assert lines.pop(0) == "    > " + " ".join(span["text"].split())
    assert lines == []


def test_ask_with_a_collection_filter(server, capsys):
    base, _, _ = server
    assert main(["ask", "anything?", "--url", base, "--collection", "nothing-here"]) == 0
    assert "(no sources)" in capsys.readouterr().out


def test_ask_reports_an_unreachable_server(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["ask", "hello?", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the prefixrag server" in err and url in err


def test_ask_reports_a_rejected_question(server, capsys):
    base, _, _ = server
    assert main(["ask", "   ", "--url", base]) == 1
    assert "422" in capsys.readouterr().err
