"""The OpenAI-compatible API, driven by the official `openai` client against a live server."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.main import create_app
from tests.app.live_server import live_server

PROMPT = "The three primary colours of light are"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    data = tmp_path_factory.mktemp("openai-data")
    settings = Settings(
        data_dir=data,
        embed_model=packaged_embedder_path(),
        rerank_model=str(data / "no-cross-encoder"),
        kv_cache_gb=0.1,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        index_use_gpu="no",
    )
    _share_converted_weights(settings, request)
    app = create_app(settings)
    with live_server(app) as base:
        yield base, app.state.prefixrag


def _share_converted_weights(settings: Settings, request: pytest.FixtureRequest) -> None:
    # Converting the GGUF takes a while: reuse the engine tests' converted copy.
    cache = Path(request.config.cache.mkdir("prefixrag-engine-models"))
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    (settings.cache_dir / "models").symlink_to(cache, target_is_directory=True)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    base, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_loaded_model(model_id):
    assert model_id == "SmolLM2-135M-Instruct.Q4_1"


def test_completion_stream_equals_non_stream_and_reports_usage(client, model_id, server):
    _, state = server
    full = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=model_id,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and streamed
    assert full.choices[0].finish_reason == "length"
    prompt_tokens = len(state.llm.encode(PROMPT))
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 20
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    # the same prompt again: its whole blocks but the last come from the prefix cache
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // 16 * 16


def test_chat_stream_and_non_stream(client, model_id, server):
    _, state = server
    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=12, temperature=0
    )
    stream = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert full.choices[0].message.role == "assistant"
    templated = state.llm.chat_prompt([{"role": "user", "content": "Name a colour."}])
    assert full.usage.prompt_tokens == len(state.llm.encode(templated))
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"max_tokens": 0}, openai.UnprocessableEntityError, "max_tokens"),
        ({"temperature": 5}, openai.UnprocessableEntityError, "temperature"),
        ({"prompt": "word " * 9000}, openai.BadRequestError, "prompt"),
        ({"max_tokens": 2000, "prompt": "word " * 1000}, openai.BadRequestError, "max_tokens"),
        ({"max_tokens": 100_000}, openai.UnprocessableEntityError, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(client, model_id, kwargs, error, param):
    args = {"model": model_id, "prompt": PROMPT, "max_tokens": 4} | kwargs
    with pytest.raises(error) as info:
        client.completions.create(**args)
    body = info.value.body
    assert isinstance(body, dict) and body["message"] and body.get("param") == param


def test_malformed_json_is_a_422_with_an_openai_body(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "x", "messages": []})
    assert r.status_code == 422
    assert "messages" in r.json()["error"]["message"]
