"""BlockPool: ids are handed out once, freed once, and free + used always partition the pool."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.engine.kv_cache.block_pool import BlockPool, OutOfBlocksError


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert len(set(first)) == 3 and all(0 <= b < 4 for b in first)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    pool.free(first)
    assert pool.num_free_blocks == 4 and not any(pool.is_allocated(b) for b in range(4))


@pytest.mark.parametrize("bad", [[7], [-1], [0, 0], ["0"]])
def test_free_rejects_bad_ids_and_changes_nothing(bad: list) -> None:
    pool = BlockPool(4)
    taken = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free([*taken, *bad] if bad == [0, 0] else bad)
    assert pool.num_used_blocks == 1 and pool.is_allocated(taken[0])


def test_double_free_and_bad_sizes() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError):
        pool.free(ids)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(1, 32),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60),
)
def test_free_and_used_partition_the_pool(num_blocks: int, ops: list[tuple[bool, int]]) -> None:
    pool = BlockPool(num_blocks)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n <= pool.num_free_blocks:
                held.extend(pool.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
        else:
            k = min(n, len(held))
            pool.free(held[:k])
            del held[:k]
        assert len(set(held)) == len(held)
        used = {b for b in range(num_blocks) if pool.is_allocated(b)}
        assert used == set(held)
        assert pool.num_free_blocks + len(held) == num_blocks
