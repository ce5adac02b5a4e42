"""The incremental detokenizer against a whole-sequence decode, on a byte-level vocabulary and on
the packaged model's real tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.engine.detokenizer import IncrementalDetokenizer

# A byte-level vocabulary like GPT-2's: every token is raw bytes, so a multi-byte character is
# split across tokens exactly as in a real BPE model.
TEXT = "naïve café — 東京 ✓ emoji 🙂 done. STOP here </s> and more"
VOCAB = [bytes([b]) for b in range(256)] + [w.encode() for w in ("na", "ïve", " caf", "é", "🙂")]


def byte_decode(ids) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def byte_encode(text: str, rng: random.Random) -> list[int]:
    """Split the UTF-8 bytes of ``text`` into single-byte tokens (a worst case for UTF-8)."""
    del rng
    return list(text.encode())


def run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    deltas, stopped = [], None
    for i in ids:
        step = detok.add(i)
        deltas.append(step.delta)
        if step.stopped_on is not None:
            stopped = step.stopped_on
            break
    if stopped is None:
        deltas.append(detok.flush())
    return deltas, stopped


def test_deltas_concatenate_to_the_full_decode_and_never_split_a_character():
    ids = byte_encode(TEXT, random.Random(0))
    deltas, stopped = run(IncrementalDetokenizer(byte_decode), ids)
    assert stopped is None
    assert "".join(deltas) == byte_decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop", ["STOP", "</s>", "🙂", "e. S"])
def test_stop_string_ends_output_before_it_and_is_never_shown(stop):
    ids = byte_encode(TEXT, random.Random(0))
    deltas, stopped = run(IncrementalDetokenizer(byte_decode, [stop, "never-there"]), ids)
    assert stopped == stop
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    # no delta ever showed a piece of the stop string that later got withdrawn
    assert stop not in "".join(deltas)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_any_text_and_stops(text, stops):
    ids = list(text.encode())
    deltas, stopped = run(IncrementalDetokenizer(byte_decode, stops), ids)
    out = "".join(deltas)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        # the earliest complete stop string ends the output
        first_end = min(text.find(s) + len(s) for s in stops if s in text)
        cut = min(at for at, s in hits if at + len(s) <= first_end)
        assert stopped is not None
        assert out == text[:cut]
    else:
        assert stopped is None
        assert out == text


@pytest.fixture(scope="module")
def tokenizer(request):
    from prefixrag.app.core.settings import packaged_llm_path
    from prefixrag.engine.tokenizer import Tokenizer

    cache = request.config.cache.mkdir("prefixrag-engine-models")
    return Tokenizer.from_model_path(packaged_llm_path(), cache_dir=cache)


def test_real_tokenizer_streams_the_same_text_as_a_whole_decode(tokenizer):
    text = "Grüße aus Köln! 東京タワー 🙂🙃 def f(x):\n    return x ** 2  # ✓\n\n  spaced"
    ids = tokenizer.encode(text)
    deltas, _ = run(IncrementalDetokenizer(tokenizer.decode), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize(
    ("pattern", "kept"),
    [
        ("café", "naïve café"),  # a match ending on a character split across tokens
        (r"\A[^.]*\.(?=\s)", "naïve café — 東京 ✓ emoji 🙂 done."),
        ("🙂", "naïve café — 東京 ✓ emoji 🙂"),
    ],
)
def test_stop_after_pattern_ends_output_after_its_match(pattern, kept):
    ids = byte_encode(TEXT, random.Random(0))
    detok = IncrementalDetokenizer(byte_decode, stop_after=[pattern, "never-there"])
    deltas, stopped = run(detok, ids)
    assert stopped == pattern
    assert "".join(deltas) == detok.text == kept
    assert all("\ufffd" not in d for d in deltas)


def test_stop_after_never_takes_back_text_already_shown():
    # the match ends at "a" but is found only with the third "b", when "abb" has been shown: the
    # output keeps what was shown and drops the rest
    ids = list(b"abbbc")
    detok = IncrementalDetokenizer(byte_decode, stop_after=["a(?=bbb)"])
    deltas, stopped = run(detok, ids)
    assert stopped == "a(?=bbb)" and deltas == ["a", "b", "b", ""] and detok.text == "abb"
