"""CacheScope: validated at construction, immutable, and shifted past a cached run."""

import dataclasses

import pytest

from prefixrag.engine.kv_cache.cache_scope import CacheScope


def test_default_scope_is_shared_and_all_private() -> None:
    scope = CacheScope()
    assert (scope.namespace, scope.num_public_tokens) == ("", 0)
    assert CacheScope("tenant-a", 5) == CacheScope(namespace="tenant-a", num_public_tokens=5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_public_tokens": -1},
        {"num_public_tokens": 1.0},
        {"num_public_tokens": True},
        {"namespace": b"tenant-a"},
        {"namespace": 3},
    ],
)
def test_scope_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CacheScope(**kwargs)


def test_scope_is_frozen() -> None:
    scope = CacheScope("tenant-a", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scope.num_public_tokens = 0  # type: ignore[misc]


def test_after_counts_the_public_head_from_a_later_token() -> None:
    scope = CacheScope("tenant-a", 10)
    assert scope.after(4) == CacheScope("tenant-a", 6)
    assert scope.after(10) == scope.after(16) == CacheScope("tenant-a", 0)
    assert scope.after(0) == scope


def test_block_namespace_shares_only_whole_blocks_inside_the_public_head() -> None:
    scope = CacheScope("tenant-a", num_public_tokens=9)
    assert scope.num_public_blocks(4) == 2
    # blocks 0-1 end at tokens 4 and 8, inside the 9 public tokens; block 2 ends past them
    assert [scope.block_namespace(i, 4) for i in range(4)] == [b"", b"", b"tenant-a", b"tenant-a"]
    assert CacheScope("t", num_public_tokens=8).block_namespace(1, 4) == b""
    assert CacheScope("t").block_namespace(0, 4) == b"t"
