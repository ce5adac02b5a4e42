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
        # about 2,300 tokens of float16 KV, so the context window is well under the
        # max_tokens cap: the request past the window (1,000 + 2,000 tokens) is a 400, not a 422
        kv_cache_gb=0.05,
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


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty", "2"),
        ({"presence_penalty": -2.1}, "presence_penalty", "-2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.1}, "min_p", "1"),
        ({"no_repeat_ngram_size": 65}, "no_repeat_ngram_size", "64"),
        ({"logit_bias": {"5": 150}}, "logit_bias.5", "100"),
        ({"logit_bias": {"-3": 1}}, "logit_bias.-3.[key]", "0"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
        ({"logprobs": 6}, "logprobs", "5"),
        ({"n": 0}, "n", "1"),
        ({"echo": True}, "echo", "False"),
        ({"suffix": "x"}, "suffix", "Extra inputs"),  # unsupported: refused, not ignored
        ({"best_of": 2}, "best_of", "Extra inputs"),
    ],
)
def test_out_of_range_sampling_fields_are_422_naming_the_field(
    client, model_id, extra, param, message
):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert param.split(".")[0] in body["message"] and message in body["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, None),  # without logprobs: the model-level check names it
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
    ],
)
def test_chat_refuses_what_it_does_not_serve(client, model_id, extra, param):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=2, extra_body=extra
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert "top_logprobs" in body["message"] or param in body["message"]


def test_harmless_client_fields_are_accepted(client, model_id):
    out = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        user="someone",
        metadata={"k": "v"},
        response_format={"type": "text"},
    )
    assert out.choices[0].message.content is not None


def test_chat_logprobs_stream_and_non_stream(client, model_id):
    # The values are checked against the model's log-softmax in tests/engine/test_logprobs.py;
    # here: OpenAI's shape, one entry per token of the text, the same when streamed.
    messages = [{"role": "user", "content": "Name a colour."}]
    args = {"model": model_id, "messages": messages, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes) == entry.token.encode()
    chunks = list(client.chat.completions.create(**args, logprobs=True, stream=True))
    streamed = [
        c
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    # the same tokens; the second request reads the prompt's KV from the prefix cache, which
    # may move a logprob in its last float32 digits
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-3)
    assert all(c.top_logprobs == [] for c in streamed)
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_shape(client, model_id):
    out = client.completions.create(
        model=model_id,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(
        len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-5)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_n_choices_share_the_prompt_and_differ_when_sampled(client, model_id, server):
    _, state = server
    prompt = "A list of fruit, " + "apples and pears and plums, " * 6

    def three_choices(**extra):
        return client.completions.create(
            model=model_id,
            prompt=prompt,
            max_tokens=8,
            n=3,
            temperature=1.0,
            seed=5,
            extra_body={"ignore_eos": True},
            **extra,
        )

    hits_before = state.llm.engine.stats()["hit_tokens"]
    out = three_choices()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # each choice draws from its own seed
    assert out.usage.completion_tokens == 24
    # choices 1 and 2 start after choice 0 computed the prompt: each reuses its full blocks
    num_prompt = len(state.llm.encode(prompt))
    assert state.llm.engine.stats()["hit_tokens"] - hits_before >= 2 * ((num_prompt - 1) // 16 * 16)
    again = three_choices()
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chunks = list(three_choices(stream=True))
    streamed = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == [c.text for c in out.choices]
