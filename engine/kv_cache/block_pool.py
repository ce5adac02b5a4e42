"""A pool of fixed-size KV block ids; the tensors those ids index live in the model runner."""

from __future__ import annotations

from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    """Hands out block ids in ``[0, num_blocks)``; each id is either free or used, never both.

    ``free`` rejects ids that are out of range, not in use, or repeated, and changes nothing then.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # a stack: low ids go out first, and recently freed ids are reused first
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        self._is_used = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        """How many blocks can be allocated right now."""
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        """How many blocks are allocated and not yet freed."""
        return self.num_blocks - len(self._free_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``allocate(num_blocks)`` would succeed."""
        return num_blocks <= len(self._free_ids)

    def is_allocated(self, block_id: int) -> bool:
        """True when ``block_id`` is in range and currently in use."""
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            return False
        return bool(self._is_used[block_id])

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free ids; raises OutOfBlocksError if there are not that many."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free_ids):
            raise OutOfBlocksError(
                f"asked for {num_blocks} blocks, only {len(self._free_ids)} of "
                f"{self.num_blocks} are free"
            )
        block_ids = self._free_ids[len(self._free_ids) - num_blocks :]
        del self._free_ids[len(self._free_ids) - num_blocks :]
        block_ids.reverse()
        for block_id in block_ids:
            self._is_used[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return used ids to the pool; raises ValueError (and frees nothing) on a bad id."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if not self.is_allocated(block_id):
                raise ValueError(f"block {block_id!r} is not an allocated block of this pool")
        if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids freed twice in one call: {block_ids}")
        for block_id in block_ids:
            self._is_used[block_id] = 0
        self._free_ids.extend(reversed(block_ids))
