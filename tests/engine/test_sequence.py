"""Sequence: token bookkeeping and input validation."""

import pytest

from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sequence import Sequence, SequenceStatus


def test_sequence_tracks_prompt_and_completion() -> None:
    prompt = [5, 6, 7]
    scope = CacheScope("tenant-a", num_public_tokens=2)
    seq = Sequence(1, prompt, SamplingParams(max_tokens=4), cache_scope=scope)
    prompt.append(99)  # the sequence keeps its own copy
    seq.append_token(8)
    seq.append_token(9)
    assert seq.num_prompt_tokens == 3
    assert seq.prompt_token_ids == [5, 6, 7]
    assert seq.completion_token_ids == [8, 9]
    assert (seq.num_tokens, seq.num_completion_tokens, seq.last_token_id) == (5, 2, 9)
    assert seq.num_uncomputed_tokens == 5
    assert seq.cache_scope is scope
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished


@pytest.mark.parametrize(
    "args",
    [
        (1, []),
        (1, [1, -2]),
        (1, [1, 2.0]),
        (1, [True]),
        ("1", [1]),
        (1, "abc"),
    ],
)
def test_sequence_rejects_bad_input(args: tuple) -> None:
    with pytest.raises(ValueError):
        Sequence(*args)


def test_sequence_rejects_bad_scope_and_params() -> None:
    with pytest.raises(ValueError):
        Sequence(1, [1], cache_scope="tenant-a")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Sequence(1, [1], sampling_params={"max_tokens": 3})  # type: ignore[arg-type]
