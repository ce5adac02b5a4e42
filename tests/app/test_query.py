"""POST /v1/query on a real engine: JSON and SSE answers, citations, limits, prefix reuse."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from prefixrag.app.core.models import Chunk, Document
from prefixrag.app.main import create_app
from prefixrag.app.prompt.builder import Source
from prefixrag.app.prompt.parts import ANSWER_STOP, NOT_IN_SOURCES
from prefixrag.app.schemas.query import CitationOut, QueryIn
from prefixrag.app.services import qa as qa_service
from prefixrag.app.services.grounding import assess
from tests.app.conftest import LOAD_TIMEOUT_S, app_state
from tests.app.qa_helpers import ingest_docs, parse_sse, qa_settings

QUESTION = "Why did ships need the lighthouse beam?"


@pytest.fixture(scope="module")
def qa(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(tmp_path_factory.mktemp("qa-data"), request, max_question_chars=300)
    with TestClient(create_app(settings, embedder=embedder)) as client:
        if not app_state(client).wait_loaded(LOAD_TIMEOUT_S):
            raise TimeoutError("the app did not finish loading")
        assert app_state(client).snapshot()["prompt_cache"] == "ok"
        yield client, ingest_docs(client)


def ask(client: TestClient, **body: Any) -> dict[str, Any]:
    body = {"question": QUESTION, "max_tokens": 8, "temperature": 0, **body}
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def db_chunks(client: TestClient, chunk_ids: list[int]) -> dict[int, tuple[Chunk, str]]:
    sessions = app_state(client).sessions
    assert sessions is not None
    with sessions() as session:
        rows = session.execute(
            select(Chunk, Document.title).join(Document).where(Chunk.id.in_(chunk_ids))
        )
        return {chunk.id: (chunk, title) for chunk, title in rows}


def test_readyz_names_the_model_that_answers(qa):
    client, _ = qa
    body = client.get("/readyz").json()
    model = Path(app_state(client).settings.resolved_llm).name.removesuffix(".gguf")
    assert body["status"] == "ok" and body["model"] == model
    # the name clients pass as "model" to the OpenAI routes
    assert model in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_every_answer_says_whether_it_rests_on_its_sources(qa):
    client, _ = qa
    min_score = app_state(client).settings.grounded_min_score
    out = ask(client, max_tokens=24)
    cited = [CitationOut(**c) for c in out["citations"]]
    assert out["grounding"] == assess(out["answer"], cited, min_score).model_dump()
    if not out["grounding"]["grounded"]:
        support = out["grounding"]["support"]
        assert support["n"] in {c.n for c in cited} and support["text"]
    body = {"question": QUESTION, "max_tokens": 24, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/query", json=body) as response:
        events = parse_sse("".join(response.iter_text()))
    done = next(data for name, data in events if name == "done")
    assert done["grounding"] == out["grounding"]  # greedy: the same answer, the same verdict


def test_answer_cites_chunks_in_canonical_order_with_their_db_details(qa):
    client, _ = qa
    out = ask(client, top_k=4)
    cited = out["citations"]
    assert [c["n"] for c in cited] == list(range(1, len(cited) + 1)) and len(cited) == 4
    keys = [(c["document_id"], c["start"]) for c in cited]
    assert keys == sorted(keys)
    for c in cited:
        chunk, title = db_chunks(client, [c["chunk_id"]])[c["chunk_id"]]
        assert (c["text"], c["title"], c["start"], c["end"]) == (
            chunk.text,
            title,
            chunk.char_start,
            chunk.char_end,
        )
        assert c["document_id"] == chunk.document_id
    assert isinstance(out["answer"], str) and out["dropped_chunks"] == out["dropped_turns"] == 0
    assert out["chunk_ids"] == [c["chunk_id"] for c in cited]
    assert out["usage"]["completion_tokens"] <= 8
    assert set(out["timings"]) == {
        "embed_ms", "search_ms", "rerank_ms", "evidence_ms", "key_lines_ms", "ttft_ms", "tpot_ms",
        "total_ms",
    }  # fmt: skip


def test_prompt_tokens_match_tokenizing_the_whole_prompt_text(qa):
    client, _ = qa
    out = ask(client, top_k=3)
    state = app_state(client)
    assert state.prompts is not None and state.llm is not None
    sources = [
        Source(c["chunk_id"], c["document_id"], c["title"], c["text"], c["start"], c["end"])
        for c in out["citations"]
    ]
    whole = state.llm.engine.tokenizer.encode(state.prompts.text(QUESTION, sources))
    assert out["usage"]["prompt_tokens"] == len(whole)


def test_stream_events_in_order_and_deltas_make_the_answer(qa):
    client, _ = qa
    plain = ask(client, top_k=3, max_tokens=12)
    body = {"question": QUESTION, "top_k": 3, "max_tokens": 12, "temperature": 0, "stream": True}
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    names = [name for name, _ in events]
    assert names[0] == "citations" and names[-1] == "done"
    assert set(names[1:-1]) <= {"delta"}
    assert events[0][1] == {
        "citations": plain["citations"],
        "chunk_ids": plain["chunk_ids"],
        "dropped_chunks": 0,
        "dropped_turns": 0,
    }
    done = events[-1][1]
    assert "".join(data["text"] for name, data in events if name == "delta") == done["answer"]
    # greedy decoding: the stream says what the plain response says
    assert done["answer"] == plain["answer"]
    assert done["finish_reason"] in ("stop", "length")
    assert done["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_same_chunks_new_question_reuses_everything_but_the_question(qa):
    client, ids = qa
    state = app_state(client)
    assert state.llm is not None and state.prompts is not None
    block_size = state.settings.block_size
    num_pinned = state.llm.engine.stats()["blocks_pinned"] * block_size
    assert num_pinned == len(state.prompts.stable_ids) // block_size * block_size > 0
    # One document's every chunk (top_k covers them all), so both questions get the same set.
    only = {"document_ids": [ids["volcano.txt"]], "top_k": 10}
    first = ask(client, question="What rises through cracks in the crust?", **only)
    second = ask(client, question="What can ash clouds ground?", **only)
    assert [c["chunk_id"] for c in first["citations"]] == [
        c["chunk_id"] for c in second["citations"]
    ]
    question_ids = state.llm.encode("Question: What can ash clouds ground?<|im_end|>\n")
    shared = second["usage"]["prompt_tokens"] - len(question_ids) - 3  # 3: "assistant\n" turn
    assert second["usage"]["cached_tokens"] > num_pinned
    assert second["usage"]["cached_tokens"] >= shared // block_size * block_size - block_size


def test_filters_limit_the_sources(qa):
    client, ids = qa
    out = ask(client, document_ids=[ids["garden.md"]], top_k=10)
    assert out["citations"] and {c["document_id"] for c in out["citations"]} == {ids["garden.md"]}


def test_no_matching_documents_still_answers_without_sources(qa):
    client, _ = qa
    out = ask(client, collection="empty-collection")
    assert out["citations"] == [] and out["dropped_chunks"] == 0
    assert out["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"question": ""}, "question"),
        ({"question": "   \n"}, "empty"),
        ({"question": "x" * 301}, "at most 300"),
        ({"question": QUESTION, "max_tokens": 4096}, "max_tokens"),
        ({"question": QUESTION, "top_k": 0}, "top_k"),
        ({"question": QUESTION, "surprise": 1}, "surprise"),
        ({"question": QUESTION, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"question": QUESTION, "presence_penalty": -3}, "presence_penalty"),
        ({"question": QUESTION, "repetition_penalty": 0}, "repetition_penalty"),
        ({"question": QUESTION, "min_p": 1.5}, "min_p"),
        ({"question": QUESTION, "no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"question": QUESTION, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"question": QUESTION, "logit_bias": {"10000000": 1}}, "vocabulary"),
    ],
)
def test_bad_requests_are_422(qa, body, message):
    client, _ = qa
    response = client.post("/v1/query", json=body)
    assert response.status_code == 422
    assert message in response.text


def test_logit_bias_and_penalties_reach_the_answer(qa):
    client, _ = qa
    plain = ask(client, question=QUESTION, max_tokens=6)
    tok = app_state(client).llm.engine.tokenizer
    first = tok.encode(plain["answer"])[0]
    banned = ask(client, question=QUESTION, max_tokens=6, logit_bias={str(first): -100})
    assert banned["answer"] != plain["answer"]
    assert tok.encode(banned["answer"])[:1] != [first]
    # penalties and min_p are applied, not only accepted: a strong repetition penalty changes
    # a greedy answer that repeats its sources' words
    penalised = ask(client, question=QUESTION, max_tokens=24, repetition_penalty=5.0, min_p=0.1)
    assert penalised["answer"] != ask(client, question=QUESTION, max_tokens=24)["answer"]


def test_answers_default_to_the_settings_repeat_ban_and_a_request_overrides_it(qa):
    client, _ = qa
    state = app_state(client)
    pipeline = state.qa_pipeline()
    default = state.settings.answer_no_repeat_ngram_size

    def params(**body: Any) -> Any:
        query = QueryIn(question=QUESTION, **body)
        prepared = asyncio.run(
            qa_service.prepare_answer(pipeline=pipeline, query=query, tenant="default")
        )
        return prepared.params

    assert default > 0 and params().no_repeat_ngram_size == default
    settings = state.settings
    assert params().max_tokens == min(settings.answer_max_tokens, settings.max_tokens_cap)
    assert params(max_tokens=7).max_tokens == 7
    assert params(no_repeat_ngram_size=0).no_repeat_ngram_size == 0
    assert params(no_repeat_ngram_size=default + 3).no_repeat_ngram_size == default + 3
    # every answer ends where the model starts its own question, and after a first sentence
    # saying the sources do not hold the answer (tests/app/test_not_in_sources.py)
    assert params().stop == ANSWER_STOP and params().stop_after == [NOT_IN_SOURCES]
    # the engine applies what SamplingParams carries: tests/engine/test_penalties.py


def test_no_request_is_left_in_the_engine_after_answers(qa):
    client, _ = qa
    ask(client, top_k=3)
    streamed = client.post(
        "/v1/query", json={"question": QUESTION, "max_tokens": 4, "stream": True}
    )
    assert parse_sse(streamed.text)[-1][0] == "done"
    stats = app_state(client).llm.engine.stats()  # type: ignore[union-attr]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


# -- conversations ------------------------------------------------------------------------------


def turn(question: str, out: dict[str, Any]) -> dict[str, Any]:
    return {"question": question, "answer": out["answer"], "chunk_ids": out["chunk_ids"]}


def test_follow_up_reuses_the_previous_prompt_and_answer_from_the_cache(qa):
    client, _ = qa
    state = app_state(client)
    block_size = state.settings.block_size
    questions = [
        "Why did ships need the lighthouse beam?",
        "What did the keeper write in the logbook?",
        "How do tomatoes grow well?",
    ]
    prompt_tokens: dict[int, list[int]] = {}
    settings = state.settings
    # without key lines, and with them: a follow-up finds an earlier turn's key lines again
    for num_key_lines in (0, 2):
        state.settings = settings.model_copy(update={"answer_key_lines": num_key_lines})
        try:
            prompt_tokens[num_key_lines] = _converse(client, questions, block_size, num_key_lines)
        finally:
            state.settings = settings
    assert all(k > p for k, p in zip(prompt_tokens[2], prompt_tokens[0], strict=True))


def _converse(
    client: TestClient, questions: list[str], block_size: int, num_key_lines: int
) -> list[int]:
    history: list[dict[str, Any]] = []
    previous = None
    prompt_tokens = []
    for question in questions:
        out = ask(client, question=question, top_k=3, max_tokens=6, history=history)
        prompt_tokens.append(out["usage"]["prompt_tokens"])
        assert (out["timings"]["key_lines_ms"] > 0) == bool(num_key_lines)
        assert out["dropped_turns"] == 0
        cited_before = {i for t in history for i in t["chunk_ids"]}
        assert not cited_before & set(out["chunk_ids"])  # nothing laid out twice
        numbers = [c["n"] for c in out["citations"]]
        assert numbers == sorted(numbers)
        new = [c for c in out["citations"] if c["chunk_id"] in out["chunk_ids"]]
        assert [c["n"] for c in new] == list(
            range(len(cited_before) + 1, len(cited_before) + len(new) + 1)
        )
        if previous is not None:
            # everything the engine computed for the last turn (its prompt and all but the
            # last generated token), in whole blocks
            computed = previous["prompt_tokens"] + previous["completion_tokens"] - 1
            assert out["usage"]["cached_tokens"] >= computed // block_size * block_size
            assert out["usage"]["prompt_tokens"] > computed
        previous = out["usage"]
        history.append(turn(question, out))
    return prompt_tokens


def test_history_chunks_are_read_again_from_the_db(qa):
    client, ids = qa
    first = ask(client, question="What grounds aircraft?", document_ids=[ids["volcano.txt"]])
    history = [turn("What grounds aircraft?", first)]
    second = ask(
        client,
        question="And the magma?",
        document_ids=[ids["volcano.txt"]],
        top_k=10,
        history=history,
    )
    texts = {c["chunk_id"]: c["text"] for c in second["citations"]}
    for chunk_id, (chunk, _) in db_chunks(client, first["chunk_ids"]).items():
        assert texts[chunk_id] == chunk.text  # the earlier chunks keep their numbers and texts


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        (
            {"history": [{"question": "q?", "answer": "a", "chunk_ids": [987654]}]},
            404,
            "no longer exists",
        ),
        ({"collection": "empty-collection"}, 422, "collection 'default'"),
        ({"history": [{"question": " ", "answer": "a"}]}, 422, "earlier question is empty"),
        ({"history": [{"question": "x" * 301, "answer": "a"}]}, 422, "history[0].question"),
        ({"history": [{"question": "q?", "answer": "a"}] * 33}, 422, "history"),
        ({"history": [{"question": "q?", "answer": "a" * 200_000}]}, 422, "new conversation"),
        (
            {"history": [{"question": "q?", "answer": "a", "chunk_ids": [1]}] * 2},
            422,
            "more than one",
        ),
        ({"history": [{"question": "q?", "answer": "a", "extra": 1}]}, 422, "extra"),
    ],
)
def test_bad_history_is_rejected_clearly(qa, change, status, message):
    client, _ = qa
    sessions = app_state(client).sessions
    assert sessions is not None
    with sessions() as session:
        some_chunk = [session.scalars(select(Chunk.id).limit(1)).one()]
    body = {
        "question": QUESTION,
        "max_tokens": 2,
        "history": [turn("q?", {"answer": "a", "chunk_ids": some_chunk})],
        **change,
    }
    response = client.post("/v1/query", json=body)
    assert response.status_code == status, response.text
    assert message in response.text


def test_history_outside_the_chosen_documents_is_rejected(qa):
    client, ids = qa
    garden = ask(client, document_ids=[ids["garden.md"]], top_k=1, max_tokens=1)
    body = {
        "question": QUESTION,
        "document_ids": [ids["volcano.txt"]],
        "history": [turn("q?", garden)],
    }
    response = client.post("/v1/query", json=body)
    assert response.status_code == 422 and "document_ids leaves out" in response.text
