"""Evidence spans through /v1/query: offsets point at the right text of the chunk and of the
parsed document, for every parser (markdown, HTML, PDF), in JSON and in the SSE citations."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from prefixrag.app.core.models import Chunk, ChunkSentences
from prefixrag.app.main import create_app
from prefixrag.app.state import AppState
from prefixrag.retrieval.evidence import EvidenceFinder
from prefixrag.retrieval.parsing import parse_document
from tests.app.conftest import LOAD_TIMEOUT_S, app_state
from tests.app.helpers import make_pdf, upload
from tests.app.qa_helpers import parse_sse, qa_settings

MARKDOWN = (
    "# Gardening\n\n"
    "Tomatoes need plenty of sun and regular watering through the summer. "
    "Compost and well-drained loam keep the roots healthy and free of rot.\n\n"
    "## Pests\n\n"
    "* Aphids can be washed off the leaves with a gentle spray of soapy water.\n"
    "* Slugs are kept away from young plants by a ring of crushed eggshells.\n"
)
HTML = (
    "<html><head><title>Volcanoes</title></head><body><h1>Volcanoes</h1>"
    "<p>Magma rises through cracks in the crust of the earth and collects in chambers. "
    "Ash clouds from an eruption can ground aircraft for days across a whole continent.</p>"
    "<ul><li>Lava flows move slowly enough for people to walk away from them.</li></ul>"
    "</body></html>"
)
PDF_PAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Ships far out at sea used the beam to avoid the rocky coast during storms. "
    "In the morning he wrote the weather into a leather logbook.",
]
# (file name, bytes, media type, question, a phrase of the sentence that answers it)
CASES = [
    (
        "garden.md",
        MARKDOWN.encode(),
        "text/markdown",
        "How do I get rid of aphids?",
        "soapy water",
    ),
    ("volcano.html", HTML.encode(), "text/html", "Why can't planes fly after an eruption?", "Ash"),
    (
        "lighthouse.pdf",
        make_pdf(PDF_PAGES),
        "application/pdf",
        "What did ships use the beam for?",
        "rocky coast",
    ),
]


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(tmp_path_factory.mktemp("evidence-data"), request)
    with TestClient(create_app(settings, embedder=embedder)) as client:
        if not app_state(client).wait_loaded(LOAD_TIMEOUT_S):
            raise TimeoutError("the app did not finish loading")
        ids = {}
        for name, data, media_type, *_ in CASES:
            response = upload(client, name, data, content_type=media_type)
            assert response.status_code == 201 and response.json()["status"] == "ready"
            ids[name] = response.json()["id"]
        yield client, ids


def test_ingest_warms_the_sentence_cache_with_every_chunk(documents):
    client, _ = documents
    state = app_state(client)
    assert state.evidence is not None and state.sessions is not None
    with state.sessions() as session:
        num_chunks = session.scalar(select(func.count()).select_from(Chunk))
    assert num_chunks and state.evidence.num_cached == num_chunks


def test_sentences_are_stored_at_ingest_and_a_restart_reads_them_back(documents, monkeypatch):
    client, ids = documents
    state = app_state(client)
    assert state.evidence is not None and state.sessions is not None
    with state.sessions() as session:
        chunk_ids = set(session.scalars(select(Chunk.id)))
        rows = {row.chunk_id: row for row in session.scalars(select(ChunkSentences))}
    assert set(rows) == chunk_ids
    body = {"question": CASES[0][3], "document_ids": [ids["garden.md"]]}
    before = ask(client, **body).json()["citations"]
    # a restart: the finder's cache is empty, the rows are not; no sentence is embedded again
    embedder = state.retriever.embedder
    encoded: list[str] = []
    encode = embedder.encode
    monkeypatch.setattr(embedder, "encode", lambda texts: encoded.extend(texts) or encode(texts))
    finder, state.evidence = state.evidence, EvidenceFinder(max_spans=state.evidence.max_spans)
    try:
        after = ask(client, **body).json()["citations"]
        assert after == before and set(encoded) <= {body["question"]}  # encode_query's
        # a chunk without a row (a document stored before the rows existed) gets one
        cited = [c["chunk_id"] for c in after]
        with state.sessions() as session:
            session.execute(delete(ChunkSentences).where(ChunkSentences.chunk_id.in_(cited)))
            session.commit()
        state.evidence = EvidenceFinder(max_spans=finder.max_spans)
        assert ask(client, **body).json()["citations"] == before
        assert set(encoded) - {body["question"]}
        with state.sessions() as session:
            again = {row.chunk_id: row for row in session.scalars(select(ChunkSentences))}
        assert set(again) == chunk_ids
        assert all(again[i].vectors == rows[i].vectors for i in cited)
    finally:
        state.evidence = finder


def test_a_deleted_document_takes_its_stored_sentences_along(documents):
    client, _ = documents
    state = app_state(client)
    response = upload(client, "gone.md", b"# Gone\n\nA page to delete. It has two lines.\n")
    assert response.status_code == 201
    document_id = response.json()["id"]
    in_document = select(Chunk.id).where(Chunk.document_id == document_id)
    with state.sessions() as session:
        chunk_ids = list(session.scalars(in_document))
        stored = select(ChunkSentences).where(ChunkSentences.chunk_id.in_(chunk_ids))
        assert chunk_ids and len(session.scalars(stored).all()) == len(chunk_ids)
    assert client.delete(f"/v1/documents/{document_id}").status_code == 204
    with state.sessions() as session:
        assert session.scalars(stored).all() == []


def ask(client: TestClient, **body: Any) -> Any:
    response = client.post("/v1/query", json={"max_tokens": 1, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_spans_point_at_the_chunk_and_the_parsed_document(documents, case):
    client, ids = documents
    name, data, media_type, question, phrase = case
    document_text = parse_document(data, media_type).text
    out = ask(client, question=question, document_ids=[ids[name]], top_k=3).json()
    assert out["citations"]
    for c in out["citations"]:
        assert 1 <= len(c["evidence"]) <= 2
        for span in c["evidence"]:
            assert span["text"] and span["text"] == c["text"][span["start"] : span["end"]]
            assert span["text"] == document_text[span["document_start"] : span["document_end"]]
            assert span["document_start"] == c["start"] + span["start"]
        scores = [span["score"] for span in c["evidence"]]
        assert scores == sorted(scores, reverse=True)
    best = max((c["evidence"][0] for c in out["citations"]), key=lambda span: span["score"])
    assert phrase in best["text"]
    assert out["timings"]["evidence_ms"] > 0


def test_the_stream_carries_the_same_spans_as_the_json_answer(documents):
    client, ids = documents
    body = {"question": CASES[0][3], "document_ids": [ids["garden.md"]]}
    full = ask(client, **body).json()
    events = parse_sse(ask(client, **body, stream=True).text)
    cited = next(data for event, data in events if event == "citations")["citations"]
    assert [c["evidence"] for c in cited] == [c["evidence"] for c in full["citations"]]


def test_spans_can_be_turned_off(documents):
    client, ids = documents
    state = app_state(client)
    assert AppState(state.settings.model_copy(update={"evidence_spans": 0})).evidence is None
    finder, state.evidence = state.evidence, None  # what evidence_spans=0 leaves
    try:
        out = ask(client, question=CASES[1][3], document_ids=[ids["volcano.html"]]).json()
    finally:
        state.evidence = finder
    assert out["citations"] and all(c["evidence"] == [] for c in out["citations"])
    assert out["timings"]["evidence_ms"] == 0.0


def test_key_lines_put_the_best_span_before_the_question(documents):
    client, ids = documents
    state = app_state(client)
    body = {"question": CASES[2][3], "document_ids": [ids["lighthouse.pdf"]]}
    history = [{"question": "Who?", "answer": "A keeper."}]
    settings = state.settings
    try:
        state.settings = settings.model_copy(update={"answer_key_lines": 0})
        plain = ask(client, **body).json()
        unkeyed = ask(client, **body, history=history)
        state.settings = settings.model_copy(update={"answer_key_lines": 1})
        keyed = ask(client, **body).json()
        follow_up = ask(client, **body, history=history)
    finally:
        state.settings = settings
    # the best span of all the citations, with its source's number, and nothing else is added
    n, best = max(
        ((c["n"], e) for c in plain["citations"] for e in c["evidence"]),
        key=lambda pair: pair[1]["score"],
    )
    assert CASES[2][4] in best["text"]
    line = state.llm.encode(f"Key line [{n}]: {' '.join(best['text'].split())}\n")
    added = keyed["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert added == len(line)
    assert keyed["citations"] == plain["citations"]
    # a follow-up over an earlier turn that added no sources: the lines of this turn's sources
    assert follow_up.json()["usage"]["prompt_tokens"] == (
        unkeyed.json()["usage"]["prompt_tokens"] + len(line)
    )
