"""Block tables of sequences on top of the block pool, the radix prefix cache and the chunk
store, which share one pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prefixrag.engine.chunks.store import ChunkEntry, ChunkStore
from prefixrag.engine.kv_cache.block_pool import BlockPool
from prefixrag.engine.kv_cache.radix_cache import HashFn, RadixCache, RadixNode, block_key
from prefixrag.engine.sequence import Sequence


@dataclass(slots=True)
class _TreeHold:
    """One sequence's hold on the radix tree: the first ``num_tree_blocks`` of its table are tree
    blocks, kept from eviction by one lock on ``last_node``; ``block_keys`` memoizes the block
    keys of its tokens (they never change, so they outlive a preemption)."""

    block_keys: list[bytes] = field(default_factory=list)
    last_node: RadixNode | None = None
    num_tree_blocks: int = 0


class BlockManager:
    """Gives each sequence the KV blocks it needs, sharing cached prefixes through the tree.

    A sequence's table is ``block_ids``: its leading tree blocks are shared through the tree,
    the rest are private to it. Computed full blocks move into the tree as soon as they exist, so
    concurrent requests share them at once. What ties a sequence to the tree is kept here, by
    sequence id, from its first lookup until ``forget``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_cache: bool = True,
        enable_chunk_reuse: bool = False,
        model: str = "",
        on_chunk_evict: Callable[[ChunkEntry], None] | None = None,
        hash_fn: HashFn = block_key,
    ) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.cache = RadixCache(
            block_size, self.block_pool, enabled=enable_prefix_cache, hash_fn=hash_fn
        )
        # every kind of reuse is off when the prefix cache is
        self.chunks = ChunkStore(
            self.block_pool,
            block_size,
            model=model,
            enabled=enable_prefix_cache and enable_chunk_reuse,
            on_evict=on_chunk_evict,
        )
        self._holds: dict[int, _TreeHold] = {}

    @property
    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks (tree and chunk store) that eviction could free."""
        return (
            self.block_pool.num_free_blocks
            + self.cache.num_evictable_blocks
            + self.chunks.num_evictable_blocks
        )

    @property
    def num_tracked_seqs(self) -> int:
        """Sequences looked up or admitted and not yet forgotten."""
        return len(self._holds)

    def num_tree_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of ``seq``'s table the tree holds (the rest are its own)."""
        hold = self._holds.get(seq.seq_id)
        return 0 if hold is None else hold.num_tree_blocks

    def prefix_len(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``match`` would reuse now (no side effects)."""
        return self.cache.prefix_len(
            seq.token_ids,
            seq.cache_scope,
            max_num_tokens=seq.num_tokens - 1,
            keys=self._hold(seq).block_keys,
        )

    def match(self, seq: Sequence) -> int:
        """Give a table-less ``seq`` its cached prefix, locked; returns the tokens reused.

        At most ``num_tokens - 1`` tokens are reused, so at least one is computed for logits.
        """
        hold = self._hold(seq)
        if seq.block_ids or hold.last_node is not None:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        match = self.cache.match_prefix(
            seq.token_ids,
            seq.cache_scope,
            max_num_tokens=seq.num_tokens - 1,
            count_stats=False,
            keys=hold.block_keys,
        )
        self.cache.inc_lock_ref(match.last_node)
        hold.last_node = match.last_node
        hold.num_tree_blocks = len(match.block_ids)
        seq.block_ids = match.block_ids
        seq.num_computed_tokens = match.num_tokens
        return match.num_tokens

    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs for its table to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``grow(seq, num_tokens)`` would succeed."""
        return self.num_blocks_to_grow(seq, num_tokens) <= self.num_allocatable_blocks

    def max_tokens_to_compute(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could compute with every allocatable block."""
        capacity = (len(seq.block_ids) + self.num_allocatable_blocks) * self.block_size
        return capacity - seq.num_computed_tokens

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """``grow`` when it would succeed and return True; else change nothing, return False."""
        # NOTE: num_blocks_to_grow inlined, and the evictable blocks of the tree and the chunk
        # store counted only without a free block: this runs for every decode entering a block
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed > self.block_pool.num_free_blocks and needed > self.num_allocatable_blocks:
            return False
        self.grow(seq, num_tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend the table of ``seq`` to hold ``num_tokens`` tokens, evicting cached leaves
        and then chunk entries when the pool runs dry; raises OutOfBlocksError if even that is
        not enough."""
        needed = self.num_blocks_to_grow(seq, num_tokens)
        if needed == 0:
            return
        shortfall = needed - self.block_pool.num_free_blocks
        if shortfall > 0:
            shortfall -= self.cache.evict(shortfall)
        if shortfall > 0:
            self.chunks.evict(shortfall)
        seq.block_ids.extend(self.block_pool.allocate(needed))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Move the computed full blocks of ``seq`` into the tree. Where the tree holds the same
        tokens already, the sequence switches to the tree's block and frees its own copy."""
        hold = self._hold(seq)
        start = hold.num_tree_blocks
        end = seq.num_computed_tokens // self.block_size
        if end <= start or not self.cache.enabled:
            return
        bs = self.block_size
        parent = hold.last_node
        if end == start + 1 and parent is not None:
            self._cache_one_block(seq, hold, parent, start)
            return
        result = self.cache.insert(
            seq.token_ids[start * bs : end * bs],
            seq.block_ids[start:end],
            seq.cache_scope.after(start * bs),
            parent=parent,
        )
        if not result.block_ids:
            return
        seq.block_ids[start : start + len(result.block_ids)] = result.block_ids
        self.block_pool.free(result.duplicate_block_ids)
        if parent is None:
            self.cache.inc_lock_ref(result.last_node)
        else:
            self.cache.move_lock(parent, result.last_node)
        hold.last_node = result.last_node
        hold.num_tree_blocks += len(result.block_ids)

    def _cache_one_block(
        self, seq: Sequence, hold: _TreeHold, parent: RadixNode, index: int
    ) -> None:
        # a decode step filled block ``index`` right after the sequence's tree blocks
        bs = self.block_size
        namespace = seq.cache_scope.block_namespace(index, bs)
        block_id = seq.block_ids[index]
        tokens = seq.token_ids[index * bs : (index + 1) * bs]
        node = self.cache.extend_locked(parent, namespace, tokens, block_id)
        if node is None:
            return
        if node.block_id != block_id:  # the tree had these tokens: use its block, free ours
            seq.block_ids[index] = node.block_id
            self.block_pool.free([block_id])
        hold.last_node = node
        hold.num_tree_blocks += 1

    def release(self, seq: Sequence) -> None:
        """Drop every block of ``seq``: unlock its tree blocks (they stay cached, evictable) and
        free its private ones. Its KV progress resets to zero."""
        hold = self._holds.get(seq.seq_id)
        num_tree_blocks = 0
        if hold is not None:
            if hold.last_node is not None:
                self.cache.dec_lock_ref(hold.last_node)
            num_tree_blocks = hold.num_tree_blocks
            hold.last_node, hold.num_tree_blocks = None, 0
        self.block_pool.free(seq.block_ids[num_tree_blocks:])
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def forget(self, seq: Sequence) -> None:
        """``release`` a finished ``seq`` and drop all that is kept for it here."""
        self.release(seq)
        self._holds.pop(seq.seq_id, None)

    def _hold(self, seq: Sequence) -> _TreeHold:
        hold = self._holds.get(seq.seq_id)
        if hold is None:
            hold = self._holds[seq.seq_id] = _TreeHold()
        return hold
