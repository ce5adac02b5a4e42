"""RadixCache: exact prefix reuse, namespaces, locks, pins and LRU eviction of leaves.

The state machine keeps its own record of what each block holds (the namespace and the full
token prefix written into it) and checks every match against that record, so a wrong block can't
hide behind the cache's own bookkeeping.
"""

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixrag.engine.kv_cache.block_pool import BlockPool
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.kv_cache.radix_cache import RadixCache, RadixNode, block_key

BS = 2


def colliding_hash(parent_key: bytes, namespace: bytes, token_ids) -> bytes:
    """Ignores parent and namespace and has two values: collisions everywhere."""
    return bytes([sum(token_ids) % 2])


def make_cache(num_blocks: int = 16, **kwargs) -> tuple[RadixCache, BlockPool]:
    pool = BlockPool(num_blocks)
    return RadixCache(BS, pool, **kwargs), pool


def cache_tokens(cache: RadixCache, pool: BlockPool, tokens: list[int], ns: str = "") -> list[int]:
    """Insert ``tokens`` the way a sequence does: reuse the match, allocate the rest."""
    scope = CacheScope(ns)
    match = cache.match_prefix(tokens, scope, count_stats=False)
    fresh = pool.allocate(len(tokens) // BS - len(match.block_ids))
    result = cache.insert(tokens, match.block_ids + fresh, scope)
    pool.free(result.duplicate_block_ids)
    pool.free(fresh[len(result.block_ids) - len(match.block_ids) :])
    return result.block_ids


def path_of(node: RadixNode) -> list[RadixNode]:
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path


def test_match_reuses_full_blocks_only() -> None:
    cache, _ = make_cache()
    block_ids = cache_tokens(cache, cache.block_pool, [1, 2, 3, 4, 5])
    assert len(block_ids) == 2  # the partial tail [5] is not cached
    match = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (match.block_ids, match.num_tokens) == (block_ids, 4)
    assert cache.match_prefix([1, 2, 3, 4], max_num_tokens=3).block_ids == block_ids[:1]
    assert cache.match_prefix([1, 3]).num_tokens == 0
    assert (cache.queried_tokens, cache.hit_tokens) == (12, 6)


def test_insert_returns_callers_duplicates() -> None:
    cache, pool = make_cache()
    first = cache_tokens(cache, pool, [1, 2, 3, 4])
    mine = pool.allocate(2)
    result = cache.insert([1, 2, 3, 4], mine)
    assert result.block_ids == first
    assert sorted(result.duplicate_block_ids) == sorted(mine)


def test_namespaces_never_share_blocks() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 2, 3, 4], "tenant-a")
    assert cache.match_prefix([1, 2, 3, 4], CacheScope("tenant-b")).num_tokens == 0
    assert cache.prefix_len([1, 2, 3, 4], CacheScope("tenant-a")) == 4
    b_blocks = cache_tokens(cache, pool, [1, 2, 3, 4], "tenant-b")
    a_match = cache.match_prefix([1, 2, 3, 4], CacheScope("tenant-a"))
    assert set(b_blocks).isdisjoint(a_match.block_ids)


def test_public_prefix_is_shared_and_the_rest_is_not() -> None:
    cache, pool = make_cache()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # blocks of 2; the first 5 tokens are public
    blocks = pool.allocate(4)
    cache.insert(prompt, blocks, CacheScope("tenant-a", num_public_tokens=5))
    # tenant b gets the 2 full public blocks (4 tokens), never tenant a's private ones
    tenant_b = CacheScope("tenant-b", num_public_tokens=5)
    assert cache.match_prefix(prompt, tenant_b).block_ids == blocks[:2]
    a_match = cache.match_prefix(prompt, CacheScope("tenant-a", num_public_tokens=5))
    assert a_match.block_ids == blocks
    # without declaring the prefix public, a tenant shares nothing
    assert cache.match_prefix(prompt, CacheScope("tenant-b")).num_tokens == 0
    with pytest.raises(ValueError, match="another namespace"):
        cache.insert(prompt[4:], pool.allocate(2), CacheScope("tenant-b"), parent=a_match.last_node)


def test_a_snapshot_keeps_the_state_it_was_taken_in() -> None:
    cache, pool = make_cache()
    prompt = [1, 2, 3, 4, 5, 6]
    cache_tokens(cache, pool, prompt)
    before = cache.cached_keys()
    assert before is cache.cached_keys()  # unchanged tree: the same snapshot, no copy
    assert before.prefix_len(prompt) == 6
    assert cache.evict(16) == 3
    # the old snapshot is untouched by the eviction; a new one sees it
    assert before.prefix_len(prompt) == 6
    assert cache.cached_keys().prefix_len(prompt) == 0
    assert before.prefix_len(prompt, CacheScope("tenant-a")) == 0  # keys carry the namespace


def test_hash_collision_never_returns_other_tokens() -> None:
    cache, pool = make_cache(hash_fn=colliding_hash)
    cache_tokens(cache, pool, [1, 1])  # key 0
    assert cache.match_prefix([2, 2]).num_tokens == 0  # key 0 too, other tokens
    assert cache_tokens(cache, pool, [2, 2, 5, 5]) == []  # refused, not aliased
    assert cache.match_prefix([1, 1], CacheScope("other")).num_tokens == 0  # ns not in this hash
    assert pool.num_used_blocks == cache.num_cached_blocks == 1


def test_block_key_is_blake2b_of_the_length_prefixed_parts() -> None:
    # the documented encoding, built independently: keys stay stable across releases (the chunk
    # disk tier and the replica router compare them)
    for parent, ns, tokens in [(b"", b"", [1]), (b"p" * 16, b"tenant", list(range(16)))]:
        h = hashlib.blake2b(digest_size=16)
        h.update(len(parent).to_bytes(4, "little") + len(ns).to_bytes(4, "little"))
        h.update(parent + ns + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
        assert block_key(parent, ns, tokens) == h.digest()


def test_block_key_separates_its_parts() -> None:
    keys = {
        block_key(b"", b"", [1, 2]),
        block_key(b"", b"", [2, 1]),
        block_key(b"p", b"", [1, 2]),
        block_key(b"", b"n", [1, 2]),
        block_key(b"ab", b"c", [1]),
        block_key(b"a", b"bc", [1]),
    }
    assert len(keys) == 6
    assert block_key(b"x", b"y", [3]) == block_key(b"x", b"y", (3,))


def test_block_keys_are_stable() -> None:
    """Golden keys: a change of hashing or namespace encoding would orphan every cached prefix
    (the chunk KV store on disk, the router's hashes), so it must never happen by accident."""
    cache = RadixCache(4, BlockPool(8))
    prompt = list(range(1, 13))  # three blocks of 4; the first 5 tokens are public
    scope = CacheScope("tenant-a", num_public_tokens=5)
    inserted = cache.insert(prompt, cache.block_pool.allocate(3), scope)
    keys: list[bytes] = []
    match = cache.match_prefix(prompt, scope, keys=keys)
    assert match.last_node is inserted.last_node
    assert [key.hex() for key in keys] == [
        "0942c1f23dc74e8fadff93e4dfe78016",
        "0ea645b1fae4a6853fe3a62eec134953",
        "dea8db432dde94696dad4fcd75c16731",
    ]
    assert [n.namespace for n in path_of(match.last_node)[::-1]] == [b"", b"tenant-a", b"tenant-a"]


def test_eviction_is_lru_over_leaves_and_tail_first() -> None:
    cache, pool = make_cache()
    a = cache_tokens(cache, pool, [1, 1, 2, 2, 3, 3])
    b = cache_tokens(cache, pool, [4, 4, 5, 5])
    cache.match_prefix([1, 1, 2, 2, 3, 3])  # a is now the most recent
    order = []
    for _ in range(5):
        before = {n.block_id for n in cache.iter_nodes()}
        assert cache.evict(1) == 1
        (gone,) = before - {n.block_id for n in cache.iter_nodes()}
        order.append(gone)
    assert order == [b[1], b[0], a[2], a[1], a[0]]
    assert pool.num_used_blocks == 0 and cache.evicted_blocks == 5


def test_locked_and_pinned_blocks_survive_eviction() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 1, 2, 2])
    cache_tokens(cache, pool, [3, 3, 4, 4])
    cache_tokens(cache, pool, [5, 5])
    locked = cache.match_prefix([1, 1, 2, 2]).last_node
    cache.inc_lock_ref(locked)
    pinned = cache.pin([3, 3, 4, 4])
    assert cache.num_pinned_blocks == 2 and cache.num_evictable_blocks == 1
    assert cache.evict(10) == 1
    assert cache.num_cached_blocks == 4
    cache.dec_lock_ref(locked)
    cache.unpin(pinned.last_node)
    assert cache.evict(10) == 4 and pool.num_used_blocks == 0
    with pytest.raises(ValueError):
        cache.dec_lock_ref(locked)
    with pytest.raises(ValueError):
        cache.inc_lock_ref(locked)  # evicted


def test_unbalanced_unlock_and_unpin_raise() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 1])
    node = cache.match_prefix([1, 1]).last_node
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)
    with pytest.raises(ValueError):
        cache.unpin(node)
    assert node.lock_ref == 0 and node.pin_ref == 0


def test_move_lock_equals_lock_then_unlock() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 1, 2, 2, 3, 3])
    nodes = path_of(cache.match_prefix([1, 1, 2, 2, 3, 3]).last_node)[::-1]
    cache.inc_lock_ref(nodes[0])
    cache.move_lock(nodes[0], nodes[2])
    assert [n.lock_ref for n in nodes] == [1, 1, 1]
    with pytest.raises(ValueError):
        cache.move_lock(nodes[2], nodes[0])
    cache.dec_lock_ref(nodes[2])
    assert [n.lock_ref for n in nodes] == [0, 0, 0] and cache.num_evictable_blocks == 3


def tree_state(cache: RadixCache) -> list[tuple]:
    return sorted(
        (n.key, n.namespace, n.token_ids, n.lock_ref, n.pin_ref) for n in cache.iter_nodes()
    )


@pytest.mark.parametrize("cached_before", [False, True])
def test_extend_locked_equals_insert_then_move_lock(cached_before: bool) -> None:
    # the decode fast path (one block below a locked node) against the general path
    states, returned = [], []
    for fast in (False, True):
        cache, pool = make_cache()
        if cached_before:  # another sequence already holds these tokens: ours is a duplicate
            cache_tokens(cache, pool, [1, 1, 2, 2], ns="t")
        scope = CacheScope("t")
        head = cache.insert([1, 1], pool.allocate(1), scope)
        pool.free(head.duplicate_block_ids)
        cache.inc_lock_ref(head.last_node)
        mine = pool.allocate(1)
        if fast:
            node = cache.extend_locked(head.last_node, b"t", [2, 2], mine[0])
        else:
            result = cache.insert([2, 2], mine, scope, parent=head.last_node)
            cache.move_lock(head.last_node, result.last_node)
            node = result.last_node
        states.append(tree_state(cache))
        returned.append((node.token_ids, node.block_id == mine[0], node.lock_ref))
        cache.dec_lock_ref(node)
        assert cache.num_evictable_blocks == 2
    assert states[0] == states[1]
    assert returned[0] == returned[1] == ((2, 2), not cached_before, 1)


def test_extend_locked_refuses_a_hash_collision() -> None:
    cache, pool = make_cache(hash_fn=colliding_hash)
    head = cache.insert([1, 1], pool.allocate(1))
    cache.inc_lock_ref(head.last_node)
    first = cache.extend_locked(head.last_node, b"", [2, 2], pool.allocate(1)[0])
    assert first is not None
    # [4, 0] hashes like [2, 2] below the same parent but holds other tokens
    assert cache.extend_locked(head.last_node, b"", [4, 0], pool.allocate(1)[0]) is None
    assert cache.match_prefix([1, 1, 4, 0]).num_tokens == 2


def test_lookup_refreshes_whole_path() -> None:
    cache, pool = make_cache()
    cache_tokens(cache, pool, [1, 1, 2, 2, 3, 3])
    cache_tokens(cache, pool, [9, 9])
    match = cache.match_prefix([1, 1, 2, 2, 3, 3])
    newest = max(n.last_access_time for n in cache.iter_nodes())
    assert [n.last_access_time for n in path_of(match.last_node)] == [newest] * 3


def test_disabled_cache_keeps_nothing() -> None:
    cache, pool = make_cache(enabled=False)
    mine = pool.allocate(2)
    result = cache.insert([1, 1, 2, 2], mine)
    assert result.block_ids == [] and result.duplicate_block_ids == []
    assert cache.match_prefix([1, 1, 2, 2]).num_tokens == 0
    assert cache.pin([1, 1]).num_tokens == 0
    assert cache.num_cached_blocks == 0 and cache.queried_tokens == 4


def test_insert_rejects_bad_blocks() -> None:
    cache, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 1, 2, 2], [0])  # fewer ids than full blocks
    with pytest.raises(ValueError):
        cache.insert([1, 1], [3])  # not allocated
    assert cache.num_cached_blocks == 0


class CacheMachine(RuleBasedStateMachine):
    """Random operations against the cache; its state is checked against our own records."""

    hash_fn = staticmethod(block_key)
    num_blocks = 24

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.num_blocks)
        self.cache = RadixCache(BS, self.pool, hash_fn=self.hash_fn)
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> what it holds
        self.private: list[int] = []
        self.locks: list[RadixNode] = []
        self.pins: list[RadixNode] = []

    tokens = st.lists(st.integers(1, 3), max_size=8)
    namespaces = st.sampled_from(["", "a", "b"])
    publics = st.integers(0, 9)  # tokens of a lookup that any namespace may share

    @rule(tokens=tokens, ns=namespaces, public=publics, lock=st.booleans())
    def insert(self, tokens: list[int], ns: str, public: int, lock: bool) -> None:
        scope = CacheScope(ns, num_public_tokens=public)
        match = self.cache.match_prefix(tokens, scope)
        self.cache.inc_lock_ref(match.last_node)  # keep the match alive while allocating
        needed = len(tokens) // BS - len(match.block_ids)
        shortfall = needed - self.pool.num_free_blocks
        if shortfall > 0:
            self.cache.evict(shortfall)
        if not self.pool.can_allocate(needed):
            self.cache.dec_lock_ref(match.last_node)
            return
        fresh = self.pool.allocate(needed)
        for i, block in enumerate(fresh):
            end = (len(match.block_ids) + i + 1) * BS
            self.content[block] = (owner(ns, public, end), tuple(tokens[:end]))
        result = self.cache.insert(tokens, match.block_ids + fresh, scope)
        self.pool.free(result.duplicate_block_ids)
        self.pool.free(fresh[len(result.block_ids) - len(match.block_ids) :])
        self.cache.dec_lock_ref(match.last_node)
        for i, block in enumerate(result.block_ids):
            end = (i + 1) * BS
            assert self.content[block] == (owner(ns, public, end), tuple(tokens[:end]))
        if lock:
            self.cache.inc_lock_ref(result.last_node)
            self.locks.append(result.last_node)

    @rule(tokens=tokens, ns=namespaces, public=publics, limit=st.none() | st.integers(0, 8))
    def match(self, tokens: list[int], ns: str, public: int, limit: int | None) -> None:
        scope = CacheScope(ns, num_public_tokens=public)
        match = self.cache.match_prefix(tokens, scope, max_num_tokens=limit)
        assert match.num_tokens == len(match.block_ids) * BS
        assert match.num_tokens <= (len(tokens) if limit is None else min(limit, len(tokens)))
        for i, block in enumerate(match.block_ids):
            end = (i + 1) * BS
            assert self.content[block] == (owner(ns, public, end), tuple(tokens[:end]))
        if match.block_ids:
            newest = max(n.last_access_time for n in self.cache.iter_nodes())
            assert all(n.last_access_time == newest for n in path_of(match.last_node))
        peek = self.cache.prefix_len(tokens, scope, max_num_tokens=limit)
        assert peek == match.num_tokens
        snapshot = self.cache.cached_keys().prefix_len(tokens, scope)
        if self.hash_fn is block_key:  # a real hash: keys alone say what the tree holds
            assert snapshot == self.cache.prefix_len(tokens, scope)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        self.cache.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(tokens=tokens, ns=namespaces, public=publics)
    def pin(self, tokens: list[int], ns: str, public: int) -> None:
        self.pins.append(self.cache.pin(tokens, CacheScope(ns, public)).last_node)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        self.cache.unpin(self.pins.pop(i % len(self.pins)))

    @rule()
    def evict_one(self) -> None:
        leaves = [n for n in self.cache.iter_nodes() if n.is_evictable]
        before = set(self.cache.iter_nodes())
        assert self.cache.evict(1) == min(1, len(leaves))
        gone = before - set(self.cache.iter_nodes())
        if leaves:
            (node,) = gone
            assert node in leaves
            assert node.last_access_time == min(n.last_access_time for n in leaves)

    @rule(n=st.integers(0, 30))
    def evict_many(self, n: int) -> None:
        evictable = self.cache.num_evictable_blocks
        assert self.cache.evict(n) == min(n, evictable)

    @rule(n=st.integers(0, 4))
    def allocate_private(self, n: int) -> None:
        if self.pool.can_allocate(n):
            self.private.extend(self.pool.allocate(n))

    @precondition(lambda self: self.private)
    @rule(n=st.integers(1, 4))
    def free_private(self, n: int) -> None:
        self.pool.free(self.private[:n])
        del self.private[:n]

    @invariant()
    def refs_match_holders(self) -> None:
        expected_locks: dict[int, int] = {}
        expected_pins: dict[int, int] = {}
        for holders, counts in ((self.locks, expected_locks), (self.pins, expected_pins)):
            for node in holders:
                assert node.parent is not None or node is self.cache.root  # never evicted
                for n in path_of(node):
                    counts[id(n)] = counts.get(id(n), 0) + 1
        for node in self.cache.iter_nodes():
            assert node.lock_ref == expected_locks.get(id(node), 0) >= 0
            assert node.pin_ref == expected_pins.get(id(node), 0) >= 0

    @invariant()
    def blocks_partition_the_pool(self) -> None:
        nodes = list(self.cache.iter_nodes())
        tree = [n.block_id for n in nodes]
        assert len(set(tree)) == len(tree)
        assert set(tree).isdisjoint(self.private)
        used = {b for b in range(self.num_blocks) if self.pool.is_allocated(b)}
        assert used == set(tree) | set(self.private)
        assert self.cache.num_cached_blocks == len(nodes)
        assert self.cache.num_pinned_blocks == sum(n.pin_ref > 0 for n in nodes)
        unprotected = sum(n.lock_ref == 0 and n.pin_ref == 0 for n in nodes)
        assert self.cache.num_evictable_blocks == unprotected

    @invariant()
    def snapshot_holds_the_keys_of_the_tree(self) -> None:
        assert self.cache.cached_keys().keys == frozenset(n.key for n in self.cache.iter_nodes())

    @invariant()
    def nodes_hold_their_path(self) -> None:
        for node in self.cache.iter_nodes():
            path = path_of(node)[::-1]
            # a path is shared blocks, then blocks of one namespace: never two tenants
            private = [n.namespace for n in path if n.namespace]
            assert len(set(private)) <= 1
            assert all(n.namespace for n in path[len(path) - len(private) :])
            tokens = tuple(t for n in path for t in n.token_ids)
            assert self.content[node.block_id] == (node.namespace, tokens)


def owner(ns: str, public_tokens: int, block_end: int) -> bytes:
    """The namespace a block ending at token ``block_end`` must be cached in: the shared one
    while the block lies inside the public run (an independent restatement of the rule)."""
    return b"" if block_end <= public_tokens else ns.encode()


class CollidingCacheMachine(CacheMachine):
    hash_fn = staticmethod(colliding_hash)


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
CollidingCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_cache_state_machine = CacheMachine.TestCase
test_cache_state_machine_with_colliding_hash = CollidingCacheMachine.TestCase
