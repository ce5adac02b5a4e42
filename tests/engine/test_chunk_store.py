"""ChunkStore: exact lookups per tenant, block accounting, refs, pins, drops and LRU eviction.

The state machine keeps its own record of what each block was written with and of its own
recency clock, and checks the store's answers against that record, so a wrong entry can't hide
behind the store's own bookkeeping.
"""

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixrag.engine.chunks.store import ChunkEntry, ChunkSpan, ChunkStore, check_spans, chunk_key
from prefixrag.engine.kv_cache.block_manager import BlockManager
from prefixrag.engine.kv_cache.block_pool import BlockPool, OutOfBlocksError
from prefixrag.engine.sequence import Sequence as Seq

BS = 4


class CollidingStore(ChunkStore):
    """Every body gets the same key, whatever its namespace and tokens."""

    def key_for(self, namespace: str, token_ids: Sequence[int]) -> bytes:
        return b"k"


def make_store(num_blocks: int = 16, cls: type[ChunkStore] = ChunkStore, **kwargs):
    pool = BlockPool(num_blocks)
    return cls(pool, BS, **kwargs), pool


def allocated(pool: BlockPool, block_ids: list[int]) -> bool:
    return bool(block_ids) and all(pool.is_allocated(b) for b in block_ids)


# -- lookups and keys ---------------------------------------------------------------------------


def test_collision_never_returns_other_tokens_or_another_tenant() -> None:
    store, pool = make_store(cls=CollidingStore)
    entry = store.insert("a", [1, 2, 3], base_pos=0)
    assert entry is not None
    assert store.lookup("a", [1, 2, 4]) is None  # same key, other tokens
    assert store.lookup("a", [1, 2]) is None
    assert store.lookup("b", [1, 2, 3]) is None  # same key and tokens, another tenant
    assert store.lookup("a", (1, 2, 3)) is entry
    assert (store.hits, store.misses) == (1, 3)
    # insert refuses to alias: the key is taken by other content
    assert store.insert("b", [1, 2, 3], base_pos=0) is None
    assert store.insert("a", [9] * 9, base_pos=0) is None
    assert store.entries() == [entry] and entry.namespace == "a"
    assert pool.num_used_blocks == store.num_blocks == 1


def test_collision_via_monkeypatched_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChunkStore, "key_for", lambda self, ns, tokens: b"same")
    store, _ = make_store()
    b = store.insert("b", [5, 5], base_pos=3)
    assert b is not None
    assert store.lookup("a", [5, 5]) is None
    assert store.insert("a", [5, 5], base_pos=0) is None
    assert store.lookup("b", [5, 5]) is b


def test_tenants_with_equal_tokens_get_separate_entries() -> None:
    store, pool = make_store()
    a = store.insert("a", [1, 2, 3, 4, 5], base_pos=0)
    b = store.insert("b", [1, 2, 3, 4, 5], base_pos=7)
    assert a is not None and b is not None and a is not b
    assert set(a.block_ids).isdisjoint(b.block_ids)
    assert store.lookup("a", [1, 2, 3, 4, 5]) is a
    assert store.lookup("b", [1, 2, 3, 4, 5]) is b
    assert store.lookup("c", [1, 2, 3, 4, 5]) is None
    assert pool.num_used_blocks == store.num_blocks == 4


def test_chunk_key_separates_its_parts() -> None:
    keys = {
        chunk_key("", "", [1, 2]),
        chunk_key("", "", [2, 1]),
        chunk_key("a", "", [1, 2]),
        chunk_key("", "a", [1, 2]),
        chunk_key("ab", "c", [1]),
        chunk_key("a", "bc", [1]),
    }
    assert len(keys) == 6
    assert chunk_key("x", "m", [3]) == chunk_key("x", "m", (3,))
    s1, _ = make_store(model="m1")
    s2, _ = make_store(model="m2")
    assert s1.key_for("a", [1]) != s2.key_for("a", [1])


# -- insertion ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (9, 3)])
def test_insert_allocates_ceil_blocks(num_tokens: int, num_blocks: int) -> None:
    store, pool = make_store()
    tokens = list(range(num_tokens))
    entry = store.insert("a", tokens, base_pos=11, tags=["doc:1", "doc:2"])
    assert entry is not None
    assert len(entry.block_ids) == num_blocks and allocated(pool, entry.block_ids)
    assert entry.token_ids == tuple(tokens) and entry.num_tokens == num_tokens
    assert (entry.namespace, entry.base_pos, entry.tags) == ("a", 11, ("doc:1", "doc:2"))
    assert entry.key == chunk_key("a", "", tokens)
    assert store.num_blocks == pool.num_used_blocks == num_blocks
    # the same body again is the same entry, with no new blocks
    assert store.insert("a", tokens, base_pos=0) is entry
    assert store.num_entries == 1 and pool.num_used_blocks == num_blocks
    assert store.inserts == 1


def test_insert_of_no_tokens_keeps_nothing() -> None:
    store, pool = make_store()
    assert store.insert("a", [], base_pos=0) is None
    assert store.num_entries == 0 and pool.num_used_blocks == 0


def test_full_pool_returns_none_and_never_raises() -> None:
    store, pool = make_store(num_blocks=4)
    held = store.insert("a", [1] * 8, base_pos=0)  # 2 blocks
    assert held is not None
    store.acquire(held)
    other = pool.allocate(1)  # a sequence's block
    assert store.insert("a", [2] * 8, base_pos=0) is None  # 1 free, nothing evictable
    assert store.entries() == [held] and pool.num_free_blocks == 1
    small = store.insert("a", [3], base_pos=0)
    assert small is not None and pool.num_free_blocks == 0
    # can_evict=False never evicts, even when that would make room
    assert store.insert("a", [4], base_pos=0, can_evict=False) is None
    assert store.lookup("a", [3], count=False) is small
    pool.free(other)


def test_insert_evicts_the_least_recent_entries_for_room() -> None:
    evicted: list[ChunkEntry] = []
    store, pool = make_store(num_blocks=4, on_evict=evicted.append)
    a = store.insert("a", [1] * 4, base_pos=0)
    b = store.insert("a", [2] * 4, base_pos=0)
    c = store.insert("a", [3] * 8, base_pos=0)
    assert pool.num_free_blocks == 0
    assert store.lookup("a", [1] * 4) is a  # b is now the oldest
    d = store.insert("a", [4] * 4, base_pos=0)
    assert d is not None and evicted == [b]
    assert {id(e) for e in store.entries()} == {id(a), id(c), id(d)}
    assert store.lookup("a", [2] * 4) is None


# -- eviction -----------------------------------------------------------------------------------


def test_evict_is_lru_and_on_evict_sees_allocated_blocks() -> None:
    seen: list[tuple[ChunkEntry, list[int], bool, bool]] = []

    def on_evict(entry: ChunkEntry) -> None:
        in_store = any(e is entry for e in store.entries())
        seen.append((entry, list(entry.block_ids), allocated(pool, entry.block_ids), in_store))

    store, pool = make_store(on_evict=on_evict)
    a = store.insert("a", [1] * 5, base_pos=0)  # 2 blocks
    b = store.insert("a", [2] * 4, base_pos=0)
    c = store.insert("b", [3] * 4, base_pos=0)
    assert a is not None and b is not None and c is not None
    blocks = {id(e): list(e.block_ids) for e in (a, b, c)}
    assert store.lookup("a", [1] * 5) is a  # order now: b, c, a
    assert store.evict(0) == 0 and not seen
    assert store.evict(1) == 1
    assert store.evict(1) == 1
    assert store.evict(1) == 2  # a whole entry goes, never part of one
    assert [s[0] for s in seen] == [b, c, a]
    for entry, block_ids, were_allocated, was_in_store in seen:
        assert block_ids == blocks[id(entry)] and were_allocated and was_in_store
        assert entry.block_ids == []
    assert pool.num_used_blocks == store.num_blocks == store.num_entries == 0
    assert store.evictions == 3
    assert store.evict(5) == 0
    with pytest.raises(ValueError):
        store.evict(-1)


def test_acquired_and_pinned_entries_are_never_evicted() -> None:
    evicted: list[ChunkEntry] = []
    store, pool = make_store(on_evict=evicted.append)
    held = store.insert("a", [1] * 4, base_pos=0)
    pinned = store.insert("a", [2] * 8, base_pos=0)
    free = store.insert("a", [3] * 4, base_pos=0)
    assert held is not None and pinned is not None and free is not None
    store.acquire(held)
    store.acquire(held)
    store.pin(pinned)
    store.pin(pinned)
    assert store.num_blocks == 4 and store.num_evictable_blocks == 1
    assert store.evict(100) == 1 and evicted == [free]
    store.release(held)
    store.unpin(pinned)
    assert store.evict(100) == 0 and store.num_evictable_blocks == 0
    store.release(held)
    assert store.num_evictable_blocks == 1 and store.evict(100) == 1
    store.unpin(pinned)
    assert store.evict(100) == 2 and evicted == [free, held, pinned]
    assert pool.num_used_blocks == 0
    with pytest.raises(ValueError):
        store.release(held)
    with pytest.raises(ValueError):
        store.unpin(pinned)
    with pytest.raises(ValueError):
        store.acquire(held)  # evicted
    with pytest.raises(ValueError):
        store.pin(pinned)
    assert (held.ref_count, pinned.pin_count) == (0, 0)


# -- drops --------------------------------------------------------------------------------------


def test_drop_of_a_referenced_entry_waits_for_the_last_release() -> None:
    evicted: list[ChunkEntry] = []
    store, pool = make_store(on_evict=evicted.append)
    entry = store.insert("a", [1] * 6, base_pos=0, tags=("doc:1",))
    assert entry is not None
    blocks = list(entry.block_ids)
    store.acquire(entry)
    store.acquire(entry)
    assert store.drop_tag("a", "doc:1") == 1
    assert store.lookup("a", [1] * 6) is None
    assert store.insert("a", [1] * 6, base_pos=0) is not entry
    with pytest.raises(ValueError):
        store.acquire(entry)
    with pytest.raises(ValueError):
        store.pin(entry)
    store.release(entry)
    assert entry.block_ids == blocks and allocated(pool, blocks)  # a step still reads it
    assert store.evict(100) == 0
    store.release(entry)
    assert entry.block_ids == [] and not any(pool.is_allocated(b) for b in blocks)
    assert store.num_entries == store.num_blocks == store.num_evictable_blocks == 0
    assert evicted == [] and store.evictions == 0
    fresh = store.insert("a", [1] * 6, base_pos=0)
    assert fresh is not None and fresh is not entry


def test_drop_frees_unreferenced_entries_now_and_only_of_that_tenant_and_tag() -> None:
    evicted: list[ChunkEntry] = []
    store, pool = make_store(on_evict=evicted.append)
    mine = store.insert("a", [1] * 4, base_pos=0, tags=("doc:1", "src:x"))
    pinned = store.insert("a", [2] * 4, base_pos=0, tags=("doc:1",))
    other_doc = store.insert("a", [3] * 4, base_pos=0, tags=("doc:2",))
    other_tenant = store.insert("b", [1] * 4, base_pos=0, tags=("doc:1",))
    assert None not in (mine, pinned, other_doc, other_tenant)
    store.pin(pinned)
    assert store.drop_tag("a", "doc:1") == 2
    assert {id(e) for e in store.entries()} == {id(other_doc), id(other_tenant)}
    assert store.num_blocks == pool.num_used_blocks == 2
    assert store.num_evictable_blocks == 2
    store.unpin(pinned)  # the pin outlived the entry: harmless
    assert store.num_evictable_blocks == 2 and pool.num_used_blocks == 2
    assert store.drop_tag("a", "doc:1") == 0
    assert evicted == []


def test_drop_of_a_referenced_and_pinned_entry_frees_it_at_the_last_release() -> None:
    """A pin does not keep a dropped body: it goes with its last reader, never to on_evict."""
    evicted: list[ChunkEntry] = []
    store, pool = make_store(on_evict=evicted.append)
    entry = store.insert("a", [1] * 5, base_pos=0, tags=("doc:1",))
    assert entry is not None
    store.acquire(entry)
    store.pin(entry)
    assert store.drop_tag("a", "doc:1") == 1
    assert store.drop_tag("a", "doc:1") == 0  # already on its way out: not counted twice
    store.release(entry)
    assert store.num_entries == 0 and pool.num_used_blocks == 0
    store.unpin(entry)
    assert store.num_blocks == store.num_evictable_blocks == 0
    again = store.insert("a", [1] * 5, base_pos=0)
    assert again is not None and again is not entry
    assert store.evict(100) == 2 and evicted == [again]


def test_disabled_store_never_inserts_or_hits() -> None:
    store, pool = make_store(enabled=False)
    assert store.insert("a", [1, 2, 3], base_pos=0) is None
    assert store.lookup("a", [1, 2, 3]) is None
    assert store.num_entries == pool.num_used_blocks == 0
    assert (store.hits, store.misses, store.inserts) == (0, 0, 0)


def test_block_size_must_be_a_positive_int() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            ChunkStore(BlockPool(4), bad)  # type: ignore[arg-type]


# -- spans --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "length", "tags"),
    [
        (-1, 2, ()),
        (0, 0, ()),
        (0, -3, ()),
        (True, 2, ()),
        (0, True, ()),
        (1.0, 2, ()),
        (0, "2", ()),
        (0, 2, (1,)),
        (0, 2, "doc:1"),  # a bare string, not a tuple of tags
    ],
)
def test_chunk_span_rejects_bad_fields(start, length, tags) -> None:
    with pytest.raises(ValueError):
        ChunkSpan(start, length, tags)


def test_chunk_span_end_and_defaults() -> None:
    span = ChunkSpan(3, 4)
    assert (span.end, span.tags) == (7, ())
    assert ChunkSpan(0, 1, ("doc:1",)).tags == ("doc:1",)


def test_check_spans_sorts_and_accepts_adjacent_spans() -> None:
    a, b, c = ChunkSpan(0, 2), ChunkSpan(2, 3), ChunkSpan(6, 4)
    assert check_spans([c, a, b], 10) == (a, b, c)
    assert check_spans([], 0) == ()


@pytest.mark.parametrize(
    ("spans", "num_tokens"),
    [
        ([ChunkSpan(0, 3), ChunkSpan(2, 2)], 10),  # overlap
        ([ChunkSpan(4, 2), ChunkSpan(0, 5)], 10),  # overlap, given out of order
        ([ChunkSpan(3, 3), ChunkSpan(3, 1)], 10),  # same start
        ([ChunkSpan(8, 3)], 10),  # past the end
        ([ChunkSpan(0, 1)], 0),
        ([(0, 2)], 10),  # not a ChunkSpan
    ],
)
def test_check_spans_rejects_overlaps_and_overruns(spans, num_tokens: int) -> None:
    with pytest.raises(ValueError):
        check_spans(spans, num_tokens)


# -- the state machine --------------------------------------------------------------------------

NUM_BLOCKS = 24
NAMESPACES = ["a", "b", "c"]
TAGS = ["doc:1", "doc:2", "doc:3"]
RADIX = ("<radix>", (), -1)  # what a block of the competing user holds


class ChunkStoreMachine(RuleBasedStateMachine):
    """Random operations on a store sharing its pool with a competing block user."""

    store_cls: type[ChunkStore] = ChunkStore

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.store = self.store_cls(self.pool, BS, model="m", on_evict=self._on_evict)
        self.known: list[ChunkEntry] = []  # every entry ever made, in order
        self.content: dict[int, tuple[str, tuple[int, ...], int]] = {}  # block -> what it holds
        self.competitor: list[int] = []  # the radix cache's / sequences' blocks
        self.holds: list[ChunkEntry] = []  # one item per acquire not yet released
        self.pins: list[ChunkEntry] = []  # one item per pin not yet unpinned
        self.dropped: set[int] = set()  # ids of entries dropped while in the store
        self.evict_log: list[ChunkEntry] = []
        self.recency: dict[int, int] = {}  # our own clock: when each entry was last used
        self.clock = 0
        self.hits = 0
        self.misses = 0

    # -- helpers ----------------------------------------------------------------------------

    def _on_evict(self, entry: ChunkEntry) -> None:
        assert any(e is entry for e in self.store.entries())
        assert allocated(self.pool, entry.block_ids)
        assert entry.ref_count == 0 and entry.pin_count == 0 and not entry.doomed
        assert id(entry) not in self.dropped
        assert all(e is not entry for e in self.evict_log)
        for i, block in enumerate(entry.block_ids):
            assert self.content[block] == (entry.namespace, entry.token_ids, i)
        self.evict_log.append(entry)

    def _touch(self, entry: ChunkEntry) -> None:
        self.clock += 1
        self.recency[id(entry)] = self.clock

    def _live(self) -> list[ChunkEntry]:
        return [e for e in self.store.entries() if not e.doomed]

    def _lru_victims(self, shortfall: int) -> list[ChunkEntry]:
        """What evicting ``shortfall`` blocks must free: unprotected entries, oldest first."""
        free = [e for e in self.store.entries() if e.ref_count == 0 and e.pin_count == 0]
        free.sort(key=lambda e: self.recency[id(e)])
        victims, freed = [], 0
        for entry in free:
            if freed >= shortfall:
                break
            victims.append(entry)
            freed += len(entry.block_ids)
        return victims

    def _evicted_since(self, mark: int) -> list[ChunkEntry]:
        return self.evict_log[mark:]

    def _pick(self, entries: list[ChunkEntry], i: int) -> ChunkEntry:
        return entries[i % len(entries)]

    # -- rules ------------------------------------------------------------------------------

    tokens = st.lists(st.integers(1, 3), max_size=10)
    namespaces = st.sampled_from(NAMESPACES)

    @rule(
        ns=namespaces,
        tokens=tokens,
        base_pos=st.integers(0, 50),
        tags=st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True),
        can_evict=st.booleans(),
    )
    def insert(
        self, ns: str, tokens: list[int], base_pos: int, tags: list[str], can_evict: bool
    ) -> None:
        key = self.store.key_for(ns, tokens)
        occupant = next((e for e in self.store.entries() if e.key == key), None)
        needed = -(-len(tokens) // BS)
        free = self.pool.num_free_blocks
        evictable = sum(
            len(e.block_ids) for e in self.store.entries() if e.ref_count == e.pin_count == 0
        )
        victims = self._lru_victims(needed - free)
        mark, inserts = len(self.evict_log), self.store.inserts
        result = self.store.insert(ns, tokens, base_pos=base_pos, tags=tags, can_evict=can_evict)
        evicted = self._evicted_since(mark)
        same = (
            occupant is not None
            and not occupant.doomed
            and (occupant.namespace, occupant.token_ids) == (ns, tuple(tokens))
        )
        if not tokens:
            assert result is None and not evicted
        elif same:
            assert result is occupant and not evicted
            self._touch(occupant)
        elif occupant is not None:
            assert result is None and not evicted  # a key taken by other content: no alias
        elif needed <= free or (can_evict and needed <= free + evictable):
            assert result is not None
            assert evicted == ([] if needed <= free else victims)
            assert all(result is not e for e in self.known)
            assert (result.namespace, result.token_ids) == (ns, tuple(tokens))
            assert (result.base_pos, result.tags, result.key) == (base_pos, tuple(tags), key)
            assert len(result.block_ids) == needed and allocated(self.pool, result.block_ids)
            assert self.store.inserts == inserts + 1
            for i, block in enumerate(result.block_ids):
                self.content[block] = (ns, tuple(tokens), i)
            self.known.append(result)
            self._touch(result)
        else:
            assert result is None  # no room: no reuse, never an error
            if not can_evict:
                assert not evicted
            assert evicted == victims[: len(evicted)]

    @rule(ns=namespaces, tokens=tokens, body_of=st.none() | st.integers(0, 100))
    def lookup(self, ns: str, tokens: list[int], body_of: int | None) -> None:
        """A random body, or (``body_of``) one some entry holds, maybe another tenant's."""
        if body_of is not None and self.store.entries():
            tokens = list(self._pick(self.store.entries(), body_of).token_ids)
        expected = [e for e in self._live() if e.namespace == ns and e.token_ids == tuple(tokens)]
        assert len(expected) <= 1
        found = self.store.lookup(ns, tokens)
        if found is not None:
            # never another tenant's or another body's entry, whatever the keys do
            assert found.namespace == ns and found.token_ids == tuple(tokens)
            assert not found.doomed
            self.hits += 1
            self._touch(found)
        else:
            self.misses += 1
        assert found is (expected[0] if expected else None)

    @precondition(lambda self: any(not e.doomed for e in self.store.entries()))
    @rule(i=st.integers(0, 100), how=st.sampled_from(["acquire", "pin", "both"]))
    def hold(self, i: int, how: str) -> None:
        """Acquire a looked-up live entry (as a step does), pin one, or both."""
        entry = self._pick(self._live(), i)
        if how != "pin":
            assert self.store.lookup(entry.namespace, entry.token_ids) is entry
            self.hits += 1
            self._touch(entry)
            self.store.acquire(entry)
            self.holds.append(entry)
        if how != "acquire":
            self.store.pin(entry)
            self.pins.append(entry)

    @precondition(lambda self: self.holds or self.pins)
    @rule(i=st.integers(0, 100), unpin=st.booleans())
    def let_go(self, i: int, unpin: bool) -> None:
        """Release an acquired entry, or unpin a pinned one (even one dropped since)."""
        held = self.pins if (unpin and self.pins) or not self.holds else self.holds
        entry = held.pop(i % len(held))
        if held is self.pins:
            self.store.unpin(entry)
        else:
            self.store.release(entry)
        self._touch(entry)

    @precondition(lambda self: any(not e.doomed for e in self.store.entries()))
    @rule(i=st.integers(0, 100), pin=st.booleans(), drop=st.booleans())
    def step_reads(self, i: int, pin: bool, drop: bool) -> None:
        """A step as the scheduler runs one: look up and acquire a body (maybe pinning it too,
        for good), maybe see its document deleted meanwhile, then release it."""
        entry = self._pick(self._live(), i)
        self.hold(i, "both" if pin else "acquire")
        if drop and entry.tags:
            self.drop_tag(entry.namespace, entry.tags[0], None)
            assert entry.doomed and allocated(self.pool, entry.block_ids)
        self.holds.remove(entry)
        self.store.release(entry)
        self._touch(entry)

    @precondition(
        lambda self: any(
            e.doomed or all(e is not s for s in self.store.entries()) for e in self.known
        )
    )
    @rule(i=st.integers(0, 100))
    def hold_gone_entry(self, i: int) -> None:
        in_store = self.store.entries()
        gone = [e for e in self.known if e.doomed or all(e is not s for s in in_store)]
        entry = self._pick(gone, i)
        refs, pins = entry.ref_count, entry.pin_count
        with pytest.raises(ValueError):
            self.store.acquire(entry)
        with pytest.raises(ValueError):
            self.store.pin(entry)
        assert (entry.ref_count, entry.pin_count) == (refs, pins)

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        victims = self._lru_victims(n)
        expected = sum(len(e.block_ids) for e in victims)
        mark = len(self.evict_log)
        assert self.store.evict(n) == expected
        assert self._evicted_since(mark) == victims
        assert all(e.block_ids == [] for e in victims)

    @rule(
        ns=namespaces,
        tag=st.sampled_from(TAGS),
        tag_of=st.none() | st.tuples(st.integers(0, 100), st.integers(0, 1)),
    )
    def drop_tag(self, ns: str, tag: str, tag_of: tuple[int, int] | None) -> None:
        """Drop a random (namespace, tag), or (``tag_of``) one that some entry carries."""
        tagged = [e for e in self.store.entries() if e.tags]
        if tag_of is not None and tagged:
            entry = self._pick(tagged, tag_of[0])
            ns, tag = entry.namespace, entry.tags[tag_of[1] % len(entry.tags)]
        targets = [e for e in self.store.entries() if e.namespace == ns and tag in e.tags]
        others = [e for e in self.store.entries() if all(e is not t for t in targets)]
        mark = len(self.evict_log)
        # an entry a step still reads stays listed, doomed, until its release: counted once
        live = sum(not e.doomed for e in targets)
        assert self.store.drop_tag(ns, tag) == live
        assert not self._evicted_since(mark)
        self.dropped.update(id(e) for e in targets)
        for entry in targets:
            assert self.store.lookup(ns, entry.token_ids, count=False) is None
        in_store = self.store.entries()
        assert all(any(o is e for e in in_store) for o in others)

    @rule(n=st.integers(1, 6))
    def competitor_allocate(self, n: int) -> None:
        """A sequence grows the way BlockManager.grow does: chunk entries make room."""
        shortfall = n - self.pool.num_free_blocks
        if shortfall > 0:
            victims = self._lru_victims(shortfall)
            mark = len(self.evict_log)
            self.store.evict(shortfall)
            assert self._evicted_since(mark) == victims
        if self.pool.can_allocate(n):
            blocks = self.pool.allocate(n)
            for block in blocks:
                self.content[block] = RADIX
            self.competitor.extend(blocks)

    @precondition(lambda self: self.competitor)
    @rule(n=st.integers(1, 6))
    def competitor_free(self, n: int) -> None:
        self.pool.free(self.competitor[:n])
        del self.competitor[:n]

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def refs_and_pins_match_holders(self) -> None:
        refs = Counter(id(e) for e in self.holds)
        pins = Counter(id(e) for e in self.pins)
        for entry in self.known:
            assert entry.ref_count == refs[id(entry)] >= 0
            assert entry.pin_count == pins[id(entry)] >= 0

    @invariant()
    def held_and_pinned_entries_stay(self) -> None:
        in_store = {id(e) for e in self.store.entries()}
        for entry in self.holds:
            assert id(entry) in in_store and allocated(self.pool, entry.block_ids)
        for entry in self.pins:
            if id(entry) not in self.dropped:
                assert id(entry) in in_store and allocated(self.pool, entry.block_ids)
                assert not entry.doomed

    @invariant()
    def dropped_entries_go_with_their_last_reader(self) -> None:
        in_store = {id(e) for e in self.store.entries()}
        for entry in self.known:
            if id(entry) not in self.dropped:
                assert not entry.doomed
            elif entry.ref_count > 0:
                assert entry.doomed and id(entry) in in_store
            else:
                assert id(entry) not in in_store and entry.block_ids == []

    @invariant()
    def blocks_partition_the_pool(self) -> None:
        entries = self.store.entries()
        owned = [b for e in entries for b in e.block_ids] + self.competitor
        assert len(owned) == len(set(owned))  # no block has two owners
        assert self.pool.num_free_blocks + len(owned) == NUM_BLOCKS
        assert {b for b in range(NUM_BLOCKS) if self.pool.is_allocated(b)} == set(owned)
        for entry in entries:
            assert len(entry.block_ids) == -(-entry.num_tokens // BS)
            for i, block in enumerate(entry.block_ids):
                assert self.content[block] == (entry.namespace, entry.token_ids, i)

    @invariant()
    def counters_match_a_recount(self) -> None:
        entries = self.store.entries()
        assert self.store.num_entries == len(entries)
        assert len({e.key for e in entries}) == len(entries)
        assert all(e.key == self.store.key_for(e.namespace, e.token_ids) for e in entries)
        assert self.store.num_blocks == sum(len(e.block_ids) for e in entries)
        unprotected = [e for e in entries if e.ref_count == 0 and e.pin_count == 0]
        assert self.store.num_evictable_blocks == sum(len(e.block_ids) for e in unprotected)
        assert (self.store.hits, self.store.misses) == (self.hits, self.misses)
        assert self.store.inserts == len(self.known)

    @invariant()
    def each_evicted_entry_went_to_on_evict_once(self) -> None:
        in_store = {id(e) for e in self.store.entries()}
        gone = {id(e) for e in self.known if id(e) not in in_store}
        evicted = [id(e) for e in self.evict_log]
        assert len(evicted) == len(set(evicted)) == self.store.evictions
        assert set(evicted) == gone - self.dropped


class CollidingChunkStoreMachine(ChunkStoreMachine):
    """The same, with a key that ignores the namespace and takes three values."""

    class _Store(ChunkStore):
        def key_for(self, namespace: str, token_ids: Sequence[int]) -> bytes:
            return bytes([sum(token_ids) % 3])

    store_cls = _Store


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
ChunkStoreMachine.TestCase.settings = MACHINE_SETTINGS
CollidingChunkStoreMachine.TestCase.settings = MACHINE_SETTINGS
test_chunk_store_state_machine = ChunkStoreMachine.TestCase
test_chunk_store_state_machine_with_colliding_keys = CollidingChunkStoreMachine.TestCase


# -- the block manager: radix leaves first, then chunk entries ---------------------------------


def test_grow_evicts_radix_leaves_before_chunk_entries() -> None:
    evicted: list[ChunkEntry] = []
    bm = BlockManager(8, BS, enable_chunk_reuse=True, on_chunk_evict=evicted.append)
    chunks, cache, pool = bm.chunks, bm.cache, bm.block_pool
    # chunk entries first, so they are older than the tree's blocks
    old = chunks.insert("t", [7] * 8, base_pos=0)  # 2 blocks
    held = chunks.insert("t", [8] * 4, base_pos=0)
    newer = chunks.insert("t", [9] * 4, base_pos=0)
    assert old is not None and held is not None and newer is not None
    chunks.acquire(held)
    # a finished sequence leaves two full blocks in the tree
    first = Seq(1, list(range(1, 10)))
    assert bm.match(first) == 0
    bm.grow(first, 9)
    first.num_computed_tokens = 9
    bm.cache_full_blocks(first)
    bm.forget(first)
    assert cache.num_cached_blocks == cache.num_evictable_blocks == 2
    assert pool.num_free_blocks == 2
    # free 2 + tree 2 + unheld chunk blocks 3 (old and newer); held is not counted
    assert chunks.num_evictable_blocks == 3
    assert bm.num_allocatable_blocks == 7

    seq = Seq(2, [5] * 40)
    bm.grow(seq, 12)  # 3 blocks: one tree leaf goes, no chunk entry
    assert len(seq.block_ids) == 3
    assert cache.num_cached_blocks == 1 and chunks.num_entries == 3 and evicted == []
    assert bm.num_allocatable_blocks == 0 + 1 + 3

    bm.grow(seq, 20)  # 2 more: the last leaf, then the least recent chunk entry
    assert cache.num_cached_blocks == 0 and evicted == [old]
    assert pool.num_free_blocks == 1 and bm.num_allocatable_blocks == 2
    assert bm.can_grow(seq, 28) and not bm.can_grow(seq, 32)

    bm.grow(seq, 28)
    assert evicted == [old, newer] and chunks.entries() == [held]
    assert bm.num_allocatable_blocks == 0
    with pytest.raises(OutOfBlocksError):
        bm.grow(seq, 32)
    assert chunks.entries() == [held] and allocated(pool, held.block_ids)

    chunks.release(held)
    assert bm.num_allocatable_blocks == 1 and bm.can_grow(seq, 32)
    bm.grow(seq, 32)
    assert evicted == [old, newer, held] and chunks.num_entries == 0
    assert pool.num_free_blocks == 0 and len(seq.block_ids) == 8
    bm.forget(seq)
    assert pool.num_free_blocks == 8


def test_num_allocatable_blocks_ignores_a_disabled_chunk_store() -> None:
    bm = BlockManager(8, BS, enable_chunk_reuse=False)
    assert bm.chunks.insert("t", [1] * 4, base_pos=0) is None
    assert bm.num_allocatable_blocks == 8
