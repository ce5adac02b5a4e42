"""Our tokenizer against transformers' tokenizer of the same GGUF (and of a saved HF directory)."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🎉👍🏽",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\nprint(add(1, 2))",
    '{"json": [1, 2.5, null], "url": "https://example.com/a?b=c&d=e"}',
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "1234567890 3.14159 1e-10 0x1F",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke ✓"},
    ],
]


@pytest.fixture(scope="module")
def ours(request) -> Tokenizer:
    cache_dir = request.config.cache.mkdir("prefixrag-engine-models")
    return Tokenizer.from_gguf(packaged_llm_path(), cache_dir)


@pytest.fixture(scope="module")
def reference():
    directory, name = os.path.split(packaged_llm_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_encode_and_decode_match_transformers(ours, reference):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids), text
    for text in TEXTS[:3]:
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text)


def test_special_ids_and_vocab(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(reference)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours, reference, add_generation_prompt):
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_token_bytes_rebuild_the_text(ours):
    for text in TEXTS:
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(i) for i in ids).decode("utf-8") == ours.decode(ids)
    # one emoji spans several byte-level tokens, none of which is valid UTF-8 on its own
    pieces = [ours.token_bytes(i) for i in ours.encode("🎉")]
    assert len(pieces) > 1 and b"".join(pieces) == "🎉".encode()
    with pytest.raises(ValueError):
        ours.token_bytes(ours.vocab_size)


def test_hf_directory_tokenizer_matches(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == reference.encode(text, add_special_tokens=False)
        assert from_dir.encode(text, add_special_tokens=True) == reference.encode(text)
    expected = reference.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert from_dir.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False) == expected
    assert reference.eos_token_id in from_dir.eos_token_ids


def test_cached_tokenizer_skips_conversion(ours, request, monkeypatch):
    def no_conversion(path):
        raise AssertionError(f"{path} was converted again despite the cache")

    monkeypatch.setattr("prefixrag.engine.tokenizer._convert_gguf", no_conversion)
    cache_dir = request.config.cache.mkdir("prefixrag-engine-models")
    again = Tokenizer.from_gguf(packaged_llm_path(), cache_dir)
    assert again.encode(TEXTS[3]) == ours.encode(TEXTS[3])
    assert again.chat_template == ours.chat_template


def test_template_is_sandboxed_and_errors_are_value_errors(ours):
    evil = Tokenizer(
        ours.backend,
        bos_token_id=ours.bos_token_id,
        eos_token_ids=ours.eos_token_ids,
        chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}",
    )
    with pytest.raises(ValueError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        ours.apply_chat_template([{"content": "no role"}])


def test_add_bos_token_prepends_bos_once(ours):
    with_bos = Tokenizer(
        ours.backend,
        bos_token_id=ours.bos_token_id,
        eos_token_ids=ours.eos_token_ids,
        chat_template=None,
        add_bos_token=True,
    )
    plain = ours.encode("some text")
    assert with_bos.encode("some text", add_special_tokens=True) == [ours.bos_token_id, *plain]
    assert with_bos.encode("some text") == plain
    with pytest.raises(ValueError, match="no chat template"):
        with_bos.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_fresh_conversion_builds_autotokenizers_backend(reference, tmp_path):
    """The conversion goes through the generic fast class (no model config read): the same
    tokenizer.json AutoTokenizer builds."""
    fresh = Tokenizer.from_gguf(packaged_llm_path(), tmp_path)
    cached = json.loads((next(tmp_path.glob("tokenizer-*")) / "tokenizer.json").read_text())
    assert cached == json.loads(reference.backend_tokenizer.to_str())
    assert fresh.encode(TEXTS[0]) == reference.encode(TEXTS[0], add_special_tokens=False)


def test_a_word_level_vocabulary_round_trips_its_words() -> None:
    tok = Tokenizer.word_level(6)
    ids = tok.encode("<t1> <t3> <t5>", add_special_tokens=False)
    assert ids == [1, 3, 5] and tok.eos_token_ids == {5} and tok.bos_token_id is None
    assert tok.decode([1, 3]).split() == ["<t1>", "<t3>"]
