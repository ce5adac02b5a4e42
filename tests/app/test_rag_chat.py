"""The `prefixrag-rag` chat model through the official openai client against a live server."""

from __future__ import annotations

import httpx
import openai
import pytest

from prefixrag.app.api.rag_chat import RAG_MODEL
from prefixrag.app.main import create_app
from tests.app.conftest import LOAD_TIMEOUT_S
from tests.app.live_server import live_server
from tests.app.qa_helpers import ingest_docs, qa_settings

QUESTION = "What do ships use the lighthouse beam for?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(tmp_path_factory.mktemp("rag-chat-data"), request)
    app = create_app(settings, embedder=embedder)
    with live_server(app, LOAD_TIMEOUT_S) as base:
        with httpx.Client(base_url=base, timeout=LOAD_TIMEOUT_S) as http:
            ingest_docs(http)
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=RAG_MODEL,
        messages=[
            {"role": "user", "content": "Tell me about gardens."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=10,
        temperature=0,
        **kwargs,
    )


def test_models_lists_the_rag_model(client: openai.OpenAI):
    assert RAG_MODEL in [m.id for m in client.models.list().data]


def test_answer_is_grounded_with_sources(client: openai.OpenAI):
    response = ask(client)
    content = response.choices[0].message.content
    citations = response.model_extra["citations"]  # type: ignore[index]
    assert citations and [c["n"] for c in citations] == list(range(1, len(citations) + 1))
    # the last user message is the question: the lighthouse page is among the sources
    assert any("beam" in c["text"] for c in citations)
    lines = content.split("\n\nSources:\n")[1].splitlines()
    expected = []
    for c in citations:  # each source, then its best evidence span quoted
        best = c["evidence"][0]
        assert best["text"] == c["text"][best["start"] : best["end"]]
        expected += [f"[{c['n']}] {c['title']}", "    > " + " ".join(best["text"].split())]
    assert lines == expected
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens <= 10
    assert response.model == RAG_MODEL


def test_stream_matches_the_full_answer(client: openai.OpenAI):
    full = ask(client)
    chunks = list(ask(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert finishing[0].model_extra["citations"] == full.model_extra["citations"]  # type: ignore[index]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_conversation_without_a_user_message_is_rejected(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="no user message"):
        client.chat.completions.create(
            model=RAG_MODEL, messages=[{"role": "system", "content": "hi"}], max_tokens=4
        )


def test_multi_turn_messages_become_the_history_and_reuse_the_cache(client: openai.OpenAI):
    first_question = "What does the keeper write in the logbook?"
    first = client.chat.completions.create(
        model=RAG_MODEL,
        messages=[{"role": "user", "content": first_question}],
        max_tokens=6,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "ignored: the service has its own system prompt"},
        {"role": "user", "content": first_question},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": QUESTION},
    ]
    second = client.chat.completions.create(
        model=RAG_MODEL, messages=messages, max_tokens=6, temperature=0
    )
    # The second prompt repeats the first prompt and answer exactly (the Sources block cut
    # off, the chunks recovered by retrieving the first question again), so the engine
    # serves all that it computed for the first turn from its cache.
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached >= computed // 16 * 16
    assert second.usage.prompt_tokens > computed
    old = {c["chunk_id"]: c["n"] for c in first.model_extra["citations"]}  # type: ignore[index]
    for c in second.model_extra["citations"]:  # type: ignore[index]
        if c["chunk_id"] in old:
            assert c["n"] == old[c["chunk_id"]]  # an earlier source keeps its number
        else:
            assert c["n"] > len(old)
