"""The chunk KV store: the KV of source bodies, kept in the paged pool for reuse at any position.

A prompt names its source bodies as :class:`ChunkSpan` s. The first time a body is computed, its
KV is copied into blocks of its own (``ceil(tokens / block_size)`` of them, from the same pool as
the radix cache) and recorded here with the position its first token had (``base_pos``); a later
prompt that places the same body anywhere re-rotates those keys to the new positions and reuses
them (see engine/chunks/blend.py).

An entry's key is ``chunk_key(namespace, model, token_ids)``; lookups use the key only to find a
candidate and then compare namespace and tokens, as the radix cache does, so neither a collision
nor another tenant's chunk is ever handed out. Entries follow the pool's rules: ``ref_count``
while a step reads them, pins, and LRU eviction of the rest, which hands each evicted entry to
``on_evict`` first (the engine copies it to the host tier there). Pure Python: block ids only.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prefixrag.engine.kv_cache.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A source body inside a prompt: tokens ``[start, start + length)``, with ``tags`` naming
    what it came from (``"doc:12"``), so it can be dropped when that goes away.

    Raises ValueError for a negative start or a length below 1.
    """

    start: int
    length: int
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.start < 0 or self.length < 1:
            raise ValueError(f"a chunk span needs start >= 0 and length >= 1, got {self}")
        # a bare str would pass as its characters, and drop_tag would never find the document
        if isinstance(self.tags, str) or not all(isinstance(tag, str) for tag in self.tags):
            raise ValueError("chunk span tags must be a tuple of strings")

    @property
    def end(self) -> int:
        return self.start + self.length


def check_spans(spans: Sequence[ChunkSpan], num_tokens: int) -> tuple[ChunkSpan, ...]:
    """``spans`` sorted by start; ValueError if one overlaps another or runs past the prompt."""
    spans = tuple(spans)
    if not all(isinstance(span, ChunkSpan) for span in spans):
        raise ValueError("chunk spans must be ChunkSpan values")
    ordered = tuple(sorted(spans, key=lambda s: s.start))
    end = 0
    for span in ordered:
        if span.start < end:
            raise ValueError(f"chunk spans overlap at token {span.start}")
        if span.end > num_tokens:
            raise ValueError(f"chunk span {span} runs past the prompt of {num_tokens} tokens")
        end = span.end
    return ordered


def chunk_key(namespace: str, model: str, token_ids: Sequence[int]) -> bytes:
    """128-bit BLAKE2b of a length-prefixed encoding of tenant namespace, model and token ids."""
    ns, mdl = namespace.encode(), model.encode()
    h = hashlib.blake2b(struct.pack("<II", len(ns), len(mdl)), digest_size=16, person=b"chunkkv")
    h.update(ns)
    h.update(mdl)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class ChunkEntry:
    """One cached chunk body in the pool: ``block_ids[i]`` holds its tokens ``i * block_size``
    onward, computed with its first token at position ``base_pos``."""

    __slots__ = (
        "base_pos",
        "block_ids",
        "doomed",
        "key",
        "last_access",
        "namespace",
        "pin_count",
        "ref_count",
        "tags",
        "token_ids",
    )

    def __init__(
        self,
        key: bytes,
        namespace: str,
        token_ids: tuple[int, ...],
        base_pos: int,
        tags: tuple[str, ...],
        block_ids: list[int],
    ) -> None:
        self.key = key
        self.namespace = namespace
        self.token_ids = token_ids
        self.base_pos = base_pos
        self.tags = tags
        self.block_ids = block_ids
        self.ref_count = 0
        self.pin_count = 0
        self.last_access = 0
        self.doomed = False  # dropped while referenced: freed at its last release

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.pin_count == 0


class ChunkStore:
    """Chunk entries over a BlockPool shared with the radix cache; see the module docstring.

    ``model`` goes into every key, so a store (or a disk tier) never serves another model's KV.
    With ``enabled=False`` nothing is looked up or inserted.
    """

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        *,
        model: str = "",
        enabled: bool = True,
        on_evict: Callable[[ChunkEntry], None] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.model = model
        self.enabled = enabled
        self.on_evict = on_evict
        self._entries: dict[bytes, ChunkEntry] = {}
        self._clock = 0
        self._heap: list[tuple[int, bytes]] = []  # lazy LRU heap of (last_access, key)
        self._num_blocks = 0
        self._num_protected_blocks = 0  # blocks of entries with a ref or a pin
        self.hits = 0
        self.misses = 0
        self.inserts = 0
        self.evictions = 0

    # -- counters ---------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Pool blocks held by entries."""
        return self._num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks eviction could free now: those of entries neither referenced nor pinned."""
        return self._num_blocks - self._num_protected_blocks

    def entries(self) -> list[ChunkEntry]:
        """Every entry (for tests, stats and debugging)."""
        return list(self._entries.values())

    # -- lookup and references --------------------------------------------------------------

    def key_for(self, namespace: str, token_ids: Sequence[int]) -> bytes:
        return chunk_key(namespace, self.model, token_ids)

    def lookup(
        self, namespace: str, token_ids: Sequence[int], *, count: bool = True
    ) -> ChunkEntry | None:
        """The entry holding exactly ``token_ids`` for ``namespace``, recency refreshed; None on
        a miss (the hash only finds a candidate: namespace and tokens must match too)."""
        if not self.enabled:
            return None
        entry = self._entries.get(self.key_for(namespace, token_ids))
        if (
            entry is None
            or entry.doomed
            or entry.namespace != namespace
            or entry.token_ids != tuple(token_ids)
        ):
            if count:
                self.misses += 1
            return None
        if count:
            self.hits += 1
        self._touch(entry)
        return entry

    def acquire(self, entry: ChunkEntry) -> None:
        """Keep ``entry`` from eviction while a step reads it."""
        self._check_live(entry)
        if entry.is_evictable:
            self._num_protected_blocks += len(entry.block_ids)
        entry.ref_count += 1

    def release(self, entry: ChunkEntry) -> None:
        """Undo one ``acquire``; ValueError if it holds none. A dropped entry is freed now."""
        if entry.ref_count <= 0:
            raise ValueError("release of a chunk entry that is not acquired")
        entry.ref_count -= 1
        if entry.ref_count == 0 and entry.doomed:
            # dropped: it goes with its last reader, whatever pins it (as drop does unread ones)
            self._num_protected_blocks -= len(entry.block_ids)
            self._remove(entry, evicted=False)
            return
        if entry.is_evictable:
            self._num_protected_blocks -= len(entry.block_ids)
        self._touch(entry)

    def pin(self, entry: ChunkEntry) -> None:
        """Never evict ``entry`` until ``unpin``; pins nest."""
        self._check_live(entry)
        if entry.is_evictable:
            self._num_protected_blocks += len(entry.block_ids)
        entry.pin_count += 1

    def unpin(self, entry: ChunkEntry) -> None:
        if entry.pin_count <= 0:
            raise ValueError("unpin of a chunk entry that is not pinned")
        entry.pin_count -= 1
        if entry.is_evictable:
            self._num_protected_blocks -= len(entry.block_ids)
            self._touch(entry)

    # -- insertion and removal --------------------------------------------------------------

    def insert(
        self,
        namespace: str,
        token_ids: Sequence[int],
        *,
        base_pos: int,
        tags: Iterable[str] = (),
        can_evict: bool = True,
    ) -> ChunkEntry | None:
        """A new entry for ``token_ids`` with freshly allocated blocks, which the caller must
        fill with its KV before anyone reads them. Returns the existing entry if there is one,
        and None when the store is off or the pool has no room even after evicting older
        entries (``can_evict``): a full pool means no reuse, never an error."""
        if not self.enabled or not token_ids:
            return None
        existing = self.lookup(namespace, token_ids, count=False)
        if existing is not None:
            return existing
        key = self.key_for(namespace, token_ids)
        if key in self._entries:
            return None  # a hash collision: refuse rather than alias
        needed = -(-len(token_ids) // self.block_size)
        shortfall = needed - self.block_pool.num_free_blocks
        if shortfall > 0:
            # never evict for nothing: check first that eviction could make the room
            if not can_evict or self.num_evictable_blocks < shortfall:
                return None
            self.evict(shortfall)
        entry = ChunkEntry(
            key,
            namespace,
            tuple(token_ids),
            base_pos,
            tuple(tags),
            self.block_pool.allocate(needed),
        )
        self._entries[key] = entry
        self._num_blocks += needed
        self.inserts += 1
        self._touch(entry)
        return entry

    def evict(self, num_blocks: int) -> int:
        """Free entries, least recently used first, until ``num_blocks`` blocks are free or none
        is evictable; returns the blocks freed. Each goes to ``on_evict`` before its blocks."""
        if num_blocks < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({num_blocks})")
        freed = 0
        while freed < num_blocks and self._heap:
            last_access, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            # NOTE: the heap is lazy; an entry touched since it was pushed has a newer item.
            if entry is None or entry.last_access != last_access or not entry.is_evictable:
                continue
            freed += len(entry.block_ids)
            self._remove(entry, evicted=True)
        return freed

    def drop(self, entry: ChunkEntry) -> None:
        """Remove ``entry`` (its document is gone); if a step still reads it, at its release."""
        if self._entries.get(entry.key) is not entry:
            return
        if entry.ref_count:
            entry.doomed = True
            return
        if entry.pin_count:
            self._num_protected_blocks -= len(entry.block_ids)
        self._remove(entry, evicted=False)

    def drop_tag(self, namespace: str, tag: str) -> int:
        """Drop every entry of ``namespace`` tagged ``tag``; returns how many."""
        # an entry already doomed (a step still reads it) was counted by the call that doomed it
        doomed = [
            e
            for e in self._entries.values()
            if e.namespace == namespace and tag in e.tags and not e.doomed
        ]
        for entry in doomed:
            self.drop(entry)
        return len(doomed)

    # -- internals --------------------------------------------------------------------------

    def _touch(self, entry: ChunkEntry) -> None:
        self._clock += 1
        entry.last_access = self._clock
        if entry.is_evictable:
            heapq.heappush(self._heap, (entry.last_access, entry.key))
            if len(self._heap) > 2 * len(self._entries) + 64:
                self._heap = [
                    (e.last_access, k) for k, e in self._entries.items() if e.is_evictable
                ]
                heapq.heapify(self._heap)

    def _check_live(self, entry: ChunkEntry) -> None:
        if self._entries.get(entry.key) is not entry or entry.doomed:
            raise ValueError("this chunk entry is no longer in the store")

    def _remove(self, entry: ChunkEntry, *, evicted: bool) -> None:
        if evicted and self.on_evict is not None:
            self.on_evict(entry)
        del self._entries[entry.key]
        self._num_blocks -= len(entry.block_ids)
        self.block_pool.free(entry.block_ids)
        entry.block_ids = []
        if evicted:
            self.evictions += 1
